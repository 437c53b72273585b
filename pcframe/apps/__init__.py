"""Hydra applications (``pcframe-run``) and their shared configuration helpers."""
