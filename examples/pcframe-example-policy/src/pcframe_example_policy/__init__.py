"""Example pcframe plugin: an interval policy found through the ``pcframe.policies`` entry point."""

from pcframe_example_policy.policy import StepsOrSeconds

__all__ = ["StepsOrSeconds"]
