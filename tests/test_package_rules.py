"""The package rules of docs/architecture.md, checked on the import statements and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cakemp

PACKAGE = Path(cakemp.__file__).parent
# package -> the cakemp packages it must never import (front and device are siblings joined by ipc).
NEVER = {
    "checkpoint": {"model", "compute", "device", "front", "setup", "master", "ipc", "wire", "demo"},
    "wire": {"model", "compute", "device", "front", "setup", "master", "ipc", "checkpoint", "demo"},
    "ipc": {"model", "compute", "device", "front", "setup", "master", "demo"},
    "model": {"compute", "device", "front", "setup", "master", "ipc", "wire", "demo"},
    "compute": {"device", "front", "setup", "master", "ipc", "demo"},
    "device": {"front", "setup", "master", "demo", "model"},
    "setup": {"model", "compute", "device", "front", "master", "ipc", "demo"},
    "front": {"model", "compute", "device", "master", "demo"},
    "master": {"device", "front", "setup", "demo"},
}


def cakemp_imports(path: Path) -> set[str]:
    """The top-level cakemp packages (or modules) an import statement in `path` names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        names |= {m.split(".")[1] for m in modules if m.startswith("cakemp.")}
    return names


def test_no_package_imports_what_its_rule_forbids():
    """No module of a package in NEVER has an import statement naming a package it must not use."""
    broken = [f"{path.relative_to(PACKAGE)} imports cakemp.{name}"
              for package, forbidden in NEVER.items() for path in (PACKAGE / package).rglob("*.py")
              for name in cakemp_imports(path) & forbidden]
    assert broken == []


def test_front_and_setup_load_no_device_model_or_torch():
    """A fresh interpreter that imports cakemp.front and cakemp.setup has loaded no cakemp.device,
    cakemp.model or cakemp.compute module, and no torch, diffusers or transformers (the image
    components' admission, flags and file location included)."""
    code = ("import sys, cakemp.front, cakemp.setup, cakemp.checkpoint.config, cakemp.front.component_admission; "
            "print(' '.join(sorted(m for m in sys.modules if m in ('torch', 'diffusers', 'transformers') or "
            "m.startswith(('cakemp.device', 'cakemp.model', 'cakemp.compute')))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_no_function_in_the_package_is_over_60_lines():
    """Every function and method of cakemp, from its def to its last line (docstring included), is at
    most 60 lines: past that, a newcomer reads several steps in one body."""
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60]
    assert long == []
