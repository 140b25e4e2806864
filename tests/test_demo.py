"""`cakemp demo` as a user runs it: no arguments, an empty cache, to the end; from a clone's root
(where `python -m cakemp` finds the source tree first) and from anywhere else."""

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def demo(cwd: Path, cache: Path) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-m", "cakemp", "demo"], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_demo_runs_to_the_end_from_the_repository_root_and_from_elsewhere(tmp_path):
    """From the repository's root the demo builds its checkpoint in the cache, generates through a node,
    passes its check and stops the node; from another directory it does the same on the cached checkpoint,
    which `cakemp demo --checkpoint` names."""
    cache = tmp_path / "cache"
    out = demo(REPOSITORY, cache)
    assert "synthetic" in out and "gibberish" in out
    assert f"checkpoint  {cache}/cakemp/demo-" in out and "built in" in out
    assert "Once upon a time" in out and "tokens/s" in out
    assert "hidden states from the node equal one in-process BlockRunner" in out
    assert "node stopped cleanly (exit status 0)" in out
    assert [p.name.startswith("demo-") for p in (cache / "cakemp").iterdir()] == [True]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = demo(elsewhere, cache)
    assert "(reused)" in again and "node stopped cleanly (exit status 0)" in again
    assert "cakemp demo --checkpoint" in again
    # --checkpoint prints the directory the demo ran on, with its chat template, for a node of one's own
    printed = subprocess.run([sys.executable, "-m", "cakemp", "demo", "--checkpoint"], capture_output=True, text=True,
                             env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=120, check=True).stdout
    directory = Path(printed.strip())
    assert f"checkpoint  {directory} (reused)" in again and printed == f"{directory}\n"
    assert (directory / "chat_template.jinja").is_file()

