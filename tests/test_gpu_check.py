"""tools/gpu_check runs once per lent GPU, within a command's time limit: what it found must survive a run cut off."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_findings_file_holds_each_finding_as_it_is_made(tmp_path):
    """The machine section's findings are on disk while the check still runs its next (the rehearsal's attention,
    about 2 s): written as made, not at the end, so a run killed at its time limit leaves them, as whole JSON."""
    out = tmp_path / "gpu_check.json"
    check = subprocess.Popen([sys.executable, "-m", "tools.gpu_check", "--rehearse", "--sections", "attention",
                              "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, first = time.monotonic() + 120, {}
        while "machine.seconds" not in first and time.monotonic() < deadline:
            time.sleep(0.02)
            first = json.loads(out.read_text()) if out.exists() else {}  # (replaced whole: never half-written)
    finally:
        check.kill()
        check.wait()
    assert first["machine.torch"] and "machine.seconds" in first
    assert "attention.seconds" not in first  # the next section had not ended when they were on disk
    assert json.loads(out.read_text())["machine.seconds"] is not None  # killed: still whole
