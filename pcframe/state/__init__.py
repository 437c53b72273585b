"""The live training state a checkpoint saves and restores: the objects (model, optimizer,
scheduler, ``stateful=``), RNG states, the data position, migrations of old versions, the
checks before a restore, and the all-or-nothing apply."""
