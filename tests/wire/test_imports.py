"""The wire package stays free of torch, sockets and asyncio."""

from __future__ import annotations

import subprocess
import sys


def test_importing_wire_pulls_in_no_torch_asyncio_or_socket():
    """A fresh interpreter that imports cakemp.wire has not loaded torch, asyncio or socket."""
    code = (
        "import sys, cakemp.wire; "
        "print(' '.join(m for m in ('torch', 'asyncio', 'socket', 'zmq') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
