"""The integrations' ``resume=`` argument, checked when the callback is built."""

from __future__ import annotations

import pytest

from pcframe.integrations._common import check_resume


@pytest.mark.parametrize(("given", "expected"), [("auto", True), (True, True), (False, False),
                                                 (None, False), (3, 3)])  # fmt: skip
def test_accepted_values(given, expected):
    assert check_resume(given) == expected


@pytest.mark.parametrize("given", [0, -1, "latest", 2.0])
def test_a_version_that_cannot_exist_is_refused_at_once(given):
    """resume=0 was accepted and failed later, inside fit, as "version 0 cannot exist"."""
    with pytest.raises(ValueError, match=r"resume=.*a version number \(1 or more\)"):
        check_resume(given)
