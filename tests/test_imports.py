"""Starting a pcframe process does not import libraries only some paths use.

Every pcframe process (a training script, ``pcframe-run``, each rank, each restart of a
supervised run) pays its imports before it trains. scipy (the rate predictors' special
functions, ~0.3 s here), SQLAlchemy (Optuna's database storage, ~0.1 s), Numba (the
simulator's and the CPU kernels' compiler) and the framework integrations are imported
where they are used, so a plain start does not pay for them.
"""

from __future__ import annotations

import json
import subprocess

import pytest

LAZY = ("scipy", "sqlalchemy", "numba", "triton", "lightning", "transformers", "matplotlib")


@pytest.mark.parametrize("module", ["pcframe", "pcframe.apps.run", "pcframe.apps.cli"])
def test_starting_pcframe_does_not_import_what_only_some_paths_use(module, python, child_env):
    code = (
        f"import sys, json, {module}\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    proc = subprocess.run(
        [python, "-c", code], env=child_env, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert loaded.isdisjoint(LAZY), sorted(loaded & set(LAZY))
