"""Import rules of the front and the ipc layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cakemp

PACKAGE = Path(cakemp.__file__).parent


def test_front_and_run_command_import_no_torch():
    """A fresh interpreter that imports cakemp.front and cakemp.cli has not loaded torch."""
    code = "import sys, cakemp.front, cakemp.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_only_the_ipc_package_imports_zmq():
    """No module outside cakemp/ipc has an import statement naming zmq."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "zmq" or name.startswith("zmq.") for name in names):
                importers.append(path.relative_to(PACKAGE).as_posix())
    assert importers and all(p.startswith("ipc/") for p in importers), importers
