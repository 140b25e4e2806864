"""The reference is complete: every flag of every command is in docs/commands.md, in its command's
section, and every relative link of the README and docs/ names a file of the repository."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from cakemp.cli import cli

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (ROOT / "docs" / "commands.md").read_text()


def section(command: str) -> str:
    """The text of docs/commands.md's `## cakemp <command>` section, up to the next `## `."""
    match = re.search(rf"^## cakemp {command}\n(.*?)(?=^## |\Z)", COMMANDS, re.S | re.M)
    assert match, f"docs/commands.md has no section '## cakemp {command}'"
    return match.group(1)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_flag_of_a_command_is_in_its_section_of_docs_commands(command):
    text = section(command)
    flags = [opt for param in cli.commands[command].params for opt in param.opts if opt.startswith("--")]
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[` \\]", text)]
    assert flags and not missing, f"cakemp {command}: not in docs/commands.md: {', '.join(missing)}"


def test_every_relative_link_names_a_file():
    """[text](path) links that are not URLs or anchors, from README.md, SECURITY.md and docs/*.md."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_every_benchmark_the_docs_name_is_a_module_that_imports_and_runs_from_main():
    """`python -m bench.<name>` (or tools.<name>) in the README and docs/ names a module of the
    repository that imports and has the `main` that `-m` runs."""
    named = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= set(re.findall(r"python -m ((?:bench|tools)\.[a-z0-9_]+)", page.read_text()))
    missing = sorted(name for name in named if not (ROOT / (name.replace(".", "/") + ".py")).exists())
    assert named and not missing, f"named in the docs, not in the repository: {', '.join(missing)}"
    without_main = sorted(name for name in named if not callable(getattr(importlib.import_module(name), "main", None)))
    assert not without_main, f"named in the docs, with no main(): {', '.join(without_main)}"
