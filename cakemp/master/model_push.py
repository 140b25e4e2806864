"""The master's half of a zero-config push: which files a worker gets, cut into ModelDataChunks.

As Cake's master sends them (docs/protocol.md, Setup exchange): `config.json`, `tokenizer.json` (Cake aborts
without it), then either `model.safetensors` or the index rewritten to the worker's layers
(serde's pretty form: sorted keys, 2-space indent, no final newline) followed by each whole
shard holding one of them. At revision 2 a chunk is zstd-compressed (level 1, no content
size) when that makes it smaller, and carries the CRC-32 of the bytes as sent.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import zstandard

from cakemp.checkpoint.files import CONFIG, INDEX, PUSH_CHUNK_BYTES, SINGLE, TOKENIZER, in_layer
from cakemp.errors import ConfigError
from cakemp.wire import ModelDataChunk, Revision


def model_hash(model_dir: str | Path) -> str:
    """Cake's model hash: the first 4 bytes of SHA-256 of config.json's text, in hex."""
    return hashlib.sha256((Path(model_dir) / CONFIG).read_bytes()).digest()[:4].hex()


def push_files(model_dir: str | Path, layers: Sequence[str]) -> list[tuple[str, bytes | Path]]:
    """(file name, contents or path) in push order for a worker serving `layers`."""
    model_dir = Path(model_dir)
    files: list[tuple[str, bytes | Path]] = []
    for name in (CONFIG, TOKENIZER):
        if not (model_dir / name).is_file():
            raise ConfigError(f"{model_dir} has no {name}, which a zero-config push needs")
        files.append((name, model_dir / name))
    index_path = model_dir / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = {tensor: shard for tensor, shard in index["weight_map"].items()
                      if any(in_layer(tensor, layer) for layer in layers)}
        index["weight_map"] = weight_map
        rewritten = json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False).encode("utf-8")
        files.append((index_path.name, rewritten))
        files.extend((shard, model_dir / shard) for shard in sorted(set(weight_map.values())))
    elif (model_dir / SINGLE).is_file():
        files.append((SINGLE, model_dir / SINGLE))
    else:
        raise ConfigError(f"{model_dir} has neither {SINGLE} nor {INDEX}")
    return files


def model_chunks(model_dir: str | Path, layers: Sequence[str], revision: Revision,
                 chunk_bytes: int = PUSH_CHUNK_BYTES) -> Iterator[ModelDataChunk]:
    """Every chunk of the push for `layers`, read from disk one chunk at a time."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False)
    for name, source in push_files(model_dir, layers):
        for offset, total, piece in _pieces(source, chunk_bytes):
            if revision < Revision.V2:
                yield ModelDataChunk(name, offset, total, piece)
                continue
            packed = compressor.compress(piece)
            compressed = len(packed) < len(piece)
            data = packed if compressed else piece
            yield ModelDataChunk(name, offset, total, data, compressed, zlib.crc32(data))


def _pieces(source: bytes | Path, chunk_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """(offset, total size, bytes) of each chunk of `source`; a zero-length file has none, as in Cake."""
    if isinstance(source, bytes):
        for offset in range(0, len(source), chunk_bytes):
            yield offset, len(source), source[offset:offset + chunk_bytes]
        return
    total = source.stat().st_size
    with open(source, "rb") as f:
        offset = 0
        while piece := f.read(chunk_bytes):
            yield offset, total, piece
            offset += len(piece)
