"""``PcframeCheckpoint``: pcframe's engine as a Lightning checkpoint callback.

    checkpoint = PcframeCheckpoint("ckpts-lightning", every_n_train_steps=50)  # or policy="young"
    trainer = L.Trainer(max_steps=1000, callbacks=[checkpoint])  # devices=4, strategy="ddp" too
    trainer.fit(model, train_dataloaders=loader)  # resumes from the newest valid version

One concept a module:

- :mod:`.callback`: the callback's lifecycle (open the engine in ``on_fit_start``, resume,
  save in ``on_train_batch_end``, close on every way out of ``fit``).
- :mod:`.options`: its arguments: Lightning's spellings of an interval, the options refused
  when it is made, the strategies it cannot save.
- :mod:`.section`: the ``lightning`` section of a version: what Lightning's own checkpoint
  holds besides tensors (loops, callbacks, datamodule, data positions), applied all or nothing.
- :mod:`.processes`: a fit of several processes: a ``DistributedCheckpointer`` on every rank
  and the ranks' agreement on the resume.
- :mod:`.messages`: the lines it writes on Lightning's logger.
"""

from pcframe.integrations._common import require_library

# Before any submodule imports Lightning: without it, one line naming the extra.
require_library("lightning.pytorch", "lightning", "lightning")

from pcframe.integrations.lightning.callback import PcframeCheckpoint  # noqa: E402

__all__ = ["PcframeCheckpoint"]
