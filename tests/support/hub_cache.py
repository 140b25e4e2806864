"""A Hugging Face hub cache written as huggingface_hub lays it out, for tests (no network)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_snapshot(cache: Path, repo_id: str, files: dict[str, str | Path], commit: str = COMMIT,
                   ref: str | None = "main") -> Path:
    """`repo_id`'s snapshot at `commit` in `cache`: each file (text, or a file to copy) a blob under
    blobs/, linked from snapshots/<commit>/<name>, and refs/<ref> holding the commit. The snapshot's folder."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        blob = folder / "blobs" / f"{commit[:8]}-{name}"
        if isinstance(content, Path):
            shutil.copyfile(content, blob)
        else:
            blob.write_text(content)
        (snapshot / name).symlink_to(blob)
    if ref is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot
