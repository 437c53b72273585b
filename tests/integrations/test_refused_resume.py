"""How the callbacks word a resume the engine refused because the saved state does not fit
(``pcframe.integrations._common.refused_resume``): one line naming the folder, what does not
fit and the fix a callback's user can make, every mismatch kept on the exception.

The refusals are the engine's own: a real ``Checkpointer`` restore into other objects, and
the multi-rank restore's words as it raises them (its ranks reach each other's refusal as
``"rank 1: <message>"``, a ``CheckpointError`` without the list); the Lightning and
transformers tests run the same through real fits and real rank processes.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from pcframe import Checkpointer
from pcframe.errors import CheckpointError, ReshardError, StateMismatch
from pcframe.integrations._common import refused_resume

OWNER, TAIL = "Callback", "give this run its own dirpath, or pass resume=False to start over in D"


def engine_refusal(directory: Path, **live: object) -> StateMismatch:
    """The engine's StateMismatch for a version of a float32 Linear + AdamW restored into
    the objects ``live`` changes."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(directory, model=model, optimizer=optimizer) as saving:
        saving.save(1)
    objects: dict[str, object] = {"model": model, "optimizer": optimizer, **live}
    loading = Checkpointer(directory, **objects)  # type: ignore[arg-type]
    try:
        with pytest.raises(StateMismatch) as refused:
            loading.restore()
    finally:
        loading.close()
    return refused.value


# A world of one gloo rank (its own process: the process group is global): a version of a
# float32 Linear + AdamW restored into a float64 one; the refusal's text and list.
JOB = textwrap.dedent(
    """
    import json, sys, torch
    import torch.distributed as dist
    from pcframe.distributed import DistributedCheckpointer
    from pcframe.errors import StateMismatch

    root, rendezvous = sys.argv[1:3]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with DistributedCheckpointer(root, model=model, optimizer=optimizer) as saving:
        saving.save(1).wait()
    double = torch.nn.Linear(4, 2).double()
    loading = DistributedCheckpointer(
        root, model=double, optimizer=torch.optim.AdamW(double.parameters())
    )
    try:
        loading.restore()
    except StateMismatch as exc:
        print(json.dumps({"text": str(exc), "mismatches": exc.mismatches}))
    loading.close()
    dist.destroy_process_group()
    """
)


def test_a_refusal_passed_on_by_another_rank_is_worded_from_its_list(
    tmp_path: Path, python: str, child_env: dict[str, str]
) -> None:
    """The multi-rank restore's StateMismatch ends with the engine's advice ("build them in
    the dtypes they were saved in ...", for a caller of restore(), not of a callback);
    another rank's reaches a rank as
    ``CheckpointError("rank 1: <its message>")``, its mismatches only in the text."""
    args = [python, "-c", JOB, str(tmp_path / "ckpt"), str(tmp_path / "rendezvous")]
    done = subprocess.run(args, env=child_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    refusal = json.loads(done.stdout.strip().splitlines()[-1])
    # DistributedCheckpointer.restore takes no allow_cast: its advice names none.
    assert "allow_cast" not in refusal["text"]
    assert "build them in the dtypes they were saved in" in refusal["text"]
    own = StateMismatch(refusal["text"], refusal["mismatches"])
    for error in (own, CheckpointError(f"rank 1: {refusal['text']}")):
        worded = refused_resume(OWNER, "D", error)
        assert worded is not None
        text = str(worded)
        assert len(text.splitlines()) == 1 and "allow_cast" not in text and "strict" not in text
        assert "build them in the dtypes" not in text  # the callback's own fix, said once
        assert text.startswith(
            "Callback: D holds checkpoints of a model in torch.float32, and this run's is in "
            "torch.float64 (model['weight']: dtype torch.float32 in the checkpoint, "
            "torch.float64 here; 3 more): build the model in torch.float32 as it was saved, "
        )
        assert text.endswith(TAIL)
        assert worded.mismatches == refusal["mismatches"]


def test_the_dtype_fix_is_the_callbacks_own(tmp_path: Path) -> None:
    double = torch.nn.Linear(4, 2).double()
    own = engine_refusal(tmp_path, model=double, optimizer=torch.optim.AdamW(double.parameters()))
    worded = refused_resume(OWNER, "D", own, dtype_fix="train in {} precision")
    assert worded is not None and f"train in torch.float32 precision, {TAIL}" in str(worded)


# The multi-rank restore's refusals of one line each, and what the callback makes of them.
JOB_REFUSALS = {
    "rank 0: 'model/net.0.weight' has global shape (32, 8) in global version 7 (saved by 2 "
    "ranks) but (16, 8) in this job (2 ranks); pass objects of the same shapes that were "
    "checkpointed": "of another model (rank 0: 'model/net.0.weight' has global shape (32, 8) "
    "in global version 7 (saved by 2 ranks) but (16, 8) in this job ...): ",
    "global version 3 does not fit this model: missing keys ['b'], unexpected keys ['a']; pass "
    "the same model that was checkpointed (same wrapping, e.g. DDP's 'module.' prefix)": "of "
    "another model (global version 3 does not fit this model: missing keys ['b'], unexpected "
    "keys ['a']): ",
    "global version 3 has optimizer state for parameter 5, but this optimizer has 4 "
    "parameters; pass the same optimizer setup": "of another optimizer (global version 3 has "
    "optimizer state for parameter 5, but this optimizer has 4 parameters): configure the "
    "optimizer the run was saved with (its class and param groups), ",
    "global version 4 has no 'scheduler' state, but one was given; pass the same objects that "
    "were checkpointed": "of another LR scheduler (global version 4 has no 'scheduler' state, "
    "but one was given): configure the LR scheduler the run was saved with, ",
    "global version 4 has no stateful object named 'lightning'": "that the callback did not "
    "write (global version 4 has no stateful object named 'lightning'): ",
}


@pytest.mark.parametrize("refusal", list(JOB_REFUSALS))
def test_a_multi_rank_refusal_of_one_line_names_what_does_not_fit(refusal: str) -> None:
    worded = refused_resume(OWNER, "D", CheckpointError(refusal))
    assert worded is not None
    assert str(worded) == f"Callback: D holds checkpoints {JOB_REFUSALS[refusal]}{TAIL}"
    assert worded.mismatches == [refusal]


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("rank 1 could not load global version 3 (ValueError: no); every rank"),
        CheckpointError(
            "version 2 (v00000002) does not fit the objects given to the "
            "Checkpointer: loading stateful failed (ValueError: refused)"
        ),
        ReshardError("cannot reshard: 'model/w' has global shape (9,) in global version 2"),
        ValueError("global version 3 does not fit this model"),  # not the engine's
    ],
)
def test_other_refusals_are_left_as_they_are(error: BaseException) -> None:
    """A failed load, a damaged version, a reshard: their own message says more."""
    assert refused_resume(OWNER, "D", error) is None
