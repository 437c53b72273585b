"""Drop-in integrations with the training stacks people already run.

Each submodule imports its own library (``pcframe.integrations.dcp``: torch's distributed
checkpoint); importing this package imports none of them.
"""
