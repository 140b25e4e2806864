"""Where a name is spelled in source: the check that each message is declared in one place."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path


def identifiers(paths: list[Path]) -> Counter:
    """How often each identifier is spelled in `paths`: names, attributes, imports, and the
    names of classes and functions defined."""
    spelled: Counter = Counter()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                spelled[node.id] += 1
            elif isinstance(node, ast.Attribute):
                spelled[node.attr] += 1
            elif isinstance(node, ast.alias):
                spelled[node.asname or node.name.split(".")[-1]] += 1
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                spelled[node.name] += 1
    return spelled
