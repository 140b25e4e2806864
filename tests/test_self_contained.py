"""The repository stands on its own: no tracked text points to a document outside it, and every
section of docs/ that a comment cites ("docs/protocol.md, Handshake") is there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a reference to a document outside the repository looks like. Assembled from pieces so
# that this file does not match itself.
OUTSIDE = re.compile("|".join((
    "spec " + "§", "§" + r"\d", "cake-" + "breadth", "cake-" + "model" + r"\.md", "cake-" + "protocol",
    "ISSUE-" + "NOTES", r"\.\./" + "shared",
)))
# "docs/protocol.md, Handshake": a file of docs/ and a section of it, up to the punctuation after it.
CITATION = re.compile(r"docs/(\w+\.md), ([A-Z][^.,;:)`\"]*)")


def tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    texts = {}
    for name in filter(None, (n.decode() for n in names)):
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" not in data:
            texts[name] = data.decode("utf-8", "replace")
    return texts


def headings(markdown: str) -> set[str]:
    return {line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")}


def test_no_tracked_text_points_outside_the_repository():
    """No spec section numbers, spec file names, notes files or paths into a sibling shared folder in
    any tracked text."""
    found = [f"{name}:{number}: {line.strip()}"
             for name, text in tracked_texts().items()
             for number, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_the_protocol_and_model_documents_exist():
    assert (ROOT / "docs" / "protocol.md").is_file() and (ROOT / "docs" / "models.md").is_file()


def test_every_cited_docs_section_exists():
    """Each citation of a docs/ section (the file, a comma, the heading) names a file of docs/ and the
    start of one of its headings, or of two joined by "and" (Setup exchange and Cache directory)."""
    missing = []
    for name, text in tracked_texts().items():
        joined = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # a citation may wrap onto a comment's next line
        for match in CITATION.finditer(joined):
            document = ROOT / "docs" / match.group(1)
            present = headings(document.read_text()) if document.is_file() else set()
            cited = match.group(2).strip()
            if not any(h.startswith(cited) for h in present) and not all(
                    any(h.startswith(part) for h in present) for part in cited.split(" and ")):
                missing.append(f"{name}: {match.group(0)}")
    assert not missing, "\n".join(missing)
