"""The environment variables `cakemp run` reads its flags from, taken from the click command itself,
so that the deploy files are checked against the real flags."""

from __future__ import annotations

from cakemp.cli import run


def run_variables() -> set[str]:
    names: set[str] = set()
    for param in run.params:
        names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or ())
    return names
