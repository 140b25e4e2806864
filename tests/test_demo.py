"""`cakemp demo` as a user runs it: no arguments, an empty cache, to the end."""

import os
import subprocess
import sys


def test_demo_runs_to_the_end(tmp_path):
    """The demo builds its checkpoint in the cache, generates through a node, passes its check and stops the node."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "cakemp", "demo"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "synthetic" in out and "gibberish" in out
    assert f"checkpoint  {tmp_path}/cakemp/demo-" in out and "built in" in out
    assert "Once upon a time" in out and "tokens/s" in out
    assert "hidden states from the node equal one in-process BlockRunner" in out
    assert "node stopped cleanly (exit status 0)" in out
    assert [p.name.startswith("demo-") for p in (tmp_path / "cakemp").iterdir()] == [True]
