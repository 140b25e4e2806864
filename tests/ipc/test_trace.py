"""The layout of a traced request's stamps (cakemp/ipc/trace.py)."""

from __future__ import annotations

import pytest

from cakemp.ipc import trace


def test_a_line_is_the_fronts_stamps_then_each_devices_then_the_fronts_again():
    assert trace.stamp_names(4 + 4 * 2 + 3) == [
        "read", "decoded", "admitted", "routed",
        "d0 received", "d0 stepping", "d0 stepped", "d0 sending",
        "d1 received", "d1 stepping", "d1 stepped", "d1 sending",
        "answered", "resumed", "written"]


@pytest.mark.parametrize("count", [6, 4 + 4 + 2])
def test_a_line_of_any_other_length_is_refused(count):
    with pytest.raises(ValueError, match="not 4 \\+ 4 per device \\+ 3"):
        trace.stamp_names(count)
