"""Hydra applications and their shared configuration helpers.

``run`` (``pcframe-run``), ``tune`` (``pcframe-tune``), ``sim`` (``pcframe-sim``); the
schemas in :mod:`~pcframe.apps.schemas`, ``_target_`` checks in :mod:`~pcframe.apps.instantiate`,
and :func:`~pcframe.apps.compose.compose_config` to build the same configs from Python.
"""
