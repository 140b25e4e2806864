"""tools/mutation.py's mutants still name code of this tree: a snippet a change rewrote would leave its
mutant "not applied", a survivor that says nothing about the tests."""

from pathlib import Path

from tools.mutation import MUTANTS, ROOT


def test_every_mutant_snippet_occurs_once_in_its_file():
    stale = {m.name: (ROOT / m.path).read_text().count(m.old) for m in MUTANTS
             if (ROOT / m.path).read_text().count(m.old) != 1}
    assert stale == {}


def test_every_mutant_runs_tests_that_exist():
    missing = {m.name: path for m in MUTANTS for path in m.tests
               if path.startswith("tests/") and not Path(ROOT, path.split("::")[0]).exists()}
    assert missing == {}
