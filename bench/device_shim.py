"""A node whose device process runs some code of a benchmark's first: a `sitecustomize` module on the
node's PYTHONPATH that, once `cakemp.device.process` is imported, wraps its `main` (what the front
spawns a device process to run; the front itself imports it, never calls it) so that the benchmark's
`install()` runs in the device before it loads. What bench/device_stages.py times the device's loop
with, and bench/request_cost.py's --wait-all changes how long the device waits with.
"""

from __future__ import annotations

import os
from pathlib import Path

_FINDER = '''
import importlib.util
import sys


class Finder:
    def find_spec(self, name, path, target=None):
        if name != "cakemp.device.process":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            main = module.main

            def installed(*args, **kwargs):
                install()
                return main(*args, **kwargs)

            installed.__module__, installed.__qualname__ = main.__module__, main.__qualname__  # pickled by name
            module.main = installed

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Finder())
'''


def shim_environment(folder: Path, install: str) -> dict[str, str]:
    """The environment of a node whose device runs `install` (the source of a module-level function
    `install()`, with its imports) before it loads: a sitecustomize written into `folder`, first on
    PYTHONPATH, then this checkout."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(install + _FINDER)
    root = Path(__file__).resolve().parent.parent
    return {"PYTHONPATH": f"{folder}{os.pathsep}{root}"}
