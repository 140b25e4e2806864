"""checkpoint/gguf.py, the GGUF reader, against gguf-py's GGUFReader on files its GGUFWriter
wrote; and against hostile files: every count, length and offset beyond the file, every
unknown type, is a CheckpointError naming the file, whatever the bytes (a fuzz of truncations
and byte flips included)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cakemp.checkpoint.gguf import GgufFile
from cakemp.errors import CheckpointError
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

SPEC = GgufSpec("qwen3", layers=2, types={"attn_q": "Q4_0", "attn_k": "Q6_K", "ffn_up": "F16"}, hidden=256)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    import gguf
    import numpy as np

    path = write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", SPEC)
    # Metadata of every kind beside the model's: arrays of strings and numbers, a bool, a signed int.
    extra = path.with_name("extra.gguf")
    writer = gguf.GGUFWriter(str(extra), "qwen3")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "\n"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_bool("qwen3.flag", True)
    writer.add_int32("qwen3.signed", -7)
    writer.add_uint64("qwen3.big", 1 << 40)
    writer.add_float64("qwen3.wide", 0.1)
    writer.add_tensor("token_embd.weight", np.ones((3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@needs_gguf
def test_metadata_and_tensor_places_are_gguf_py_s(written):
    import gguf

    for path in (written, written.with_name("extra.gguf")):
        ours, theirs = GgufFile(path), gguf.GGUFReader(path)
        expected = {}
        for name, field in theirs.fields.items():
            if name.startswith("GGUF."):
                continue
            value = field.contents()
            expected[name] = value
        assert ours.metadata.keys() == expected.keys()
        for key, value in expected.items():
            assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            info = ours.tensors[t.name]
            assert info.shape == tuple(int(n) for n in reversed(t.shape.tolist()))
            assert info.type.name == t.tensor_type.name
            assert (info.start, info.nbytes) == (int(t.data_offset), int(t.n_bytes))


def _header(tensors: int = 0, keys: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _tensor_info(name: bytes, ne: list[int], kind: int, offset: int) -> bytes:
    return _string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", kind, offset)


HOSTILE = {
    "not GGUF": (b"GGML" + bytes(40), "it does not start with GGUF"),
    "empty": (b"", "the magic runs past the end of the file"),
    "version 1": (_header(version=1) + bytes(32), "GGUF version 1 is not supported"),
    "2^60 tensors": (_header(tensors=1 << 60) + bytes(64), "the tensor count 1152921504606846976 cannot fit"),
    "2^60 keys": (_header(keys=1 << 60) + bytes(64), "the metadata count 1152921504606846976 cannot fit"),
    "2^18 + 1 tensors": (_header(tensors=(1 << 18) + 1) + bytes(33 << 18), "the tensor count 262145 is over 262144"),
    "2^16 + 1 keys": (_header(keys=(1 << 16) + 1) + bytes(14 << 16), "the metadata count 65537 is over 65536"),
    "an array of 2^22 + 1 numbers": (_header(keys=1) + _string(b"k") + struct.pack("<IIQ", 9, 0, (1 << 22) + 1)
                                     + bytes((1 << 22) + 8), "k's length 4194305 is over 4194304"),
    "a key of 2^24 + 1 bytes": (_header(keys=1) + struct.pack("<Q", (1 << 24) + 1) + bytes((1 << 24) + 16),
                                "a metadata key's length 16777217 is over 16777216"),
    "a key longer than the file": (_header(keys=1) + struct.pack("<Q", 1 << 62) + bytes(16),
                                   "a metadata key's length 4611686018427387904 cannot fit"),
    "an array longer than the file": (_header(keys=1) + _string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 40) + bytes(8),
                                      "k's length 1099511627776 cannot fit"),
    "a string of an array past the end": (_header(keys=1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 2)
                                          + _string(b"ab") + struct.pack("<Q", 99) + bytes(8),
                                          "string 1 of k runs past the end of the file"),
    "a string of an array not UTF-8": (_header(keys=1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 1) + _string(b"\xff")
                                       + bytes(8), "a string of k is not UTF-8"),
    "arrays nested too deep": (_header(keys=1) + _string(b"k") + struct.pack("<IIQIQIQ", 9, 9, 1, 9, 1, 9, 1) + bytes(8),
                               "k has value type 9, which GGUF does not define here"),
    "an unknown value type": (_header(keys=1) + _string(b"k") + struct.pack("<I", 13) + bytes(8),
                              "k has value type 13"),
    "a key twice": (_header(keys=2) + (_string(b"k") + struct.pack("<IB", 0, 1)) * 2 + bytes(32),
                    "metadata key 'k' appears twice"),
    "bad UTF-8": (_header(keys=1) + _string(b"\xff\xfe") + struct.pack("<IB", 0, 1) + bytes(32), "a metadata key is not UTF-8"),
    "alignment 3": (_header(keys=1) + _string(b"general.alignment") + struct.pack("<II", 4, 3) + bytes(32),
                    "general.alignment 3 is not a power of two"),
    "5 dimensions": (_header(tensors=1) + _tensor_info(b"t", [1] * 5, 0, 0) + bytes(64), "tensor t has 5 dimensions"),
    "a zero dimension": (_header(tensors=1) + _tensor_info(b"t", [0, 4], 0, 0) + bytes(64), "tensor t has shape [0, 4]"),
    "2^62 values": (_header(tensors=1) + _tensor_info(b"t", [1 << 31, 1 << 31], 0, 0) + bytes(64), "tensor t has shape"),
    "an unknown ggml type": (_header(tensors=1) + _tensor_info(b"t", [32], 99, 0) + bytes(64), "ggml type 99, which is unknown"),
    "rows not whole blocks": (_header(tensors=1) + _tensor_info(b"t", [33, 2], 8, 0) + bytes(128),
                              "tensor t's rows of 33 are not whole Q8_0 blocks of 32"),
    "data past the end": (_header(tensors=1) + _tensor_info(b"t", [64], 0, 0) + bytes(40),
                          "tensor t's 256 bytes at offset 0 lie outside"),
    "an offset not aligned": (_header(tensors=1) + _tensor_info(b"t", [4], 0, 4) + bytes(64), "at offset 4 lie outside"),
    "an offset past the end": (_header(tensors=1) + _tensor_info(b"t", [4], 0, 1 << 63) + bytes(64), "lie outside the data"),
    "a tensor twice": (_header(tensors=2) + _tensor_info(b"t", [4], 0, 0) * 2 + bytes(64), "tensor t appears twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_a_checkpoint_error_naming_it(tmp_path, case):
    data, message = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="hostile.gguf") as raised:
        GgufFile(path)
    assert message in str(raised.value)


def test_a_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        GgufFile(tmp_path / "absent.gguf")


@needs_gguf
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 16), flips=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(1, 255)), max_size=4))
def test_truncated_or_corrupted_files_raise_only_checkpoint_errors(written, tmp_path_factory, cut, flips):
    """Any prefix of a real file, with any header bytes changed, parses or is a CheckpointError."""
    data = bytearray(written.read_bytes()[: min(cut, written.stat().st_size)])
    for at, xor in flips:
        if at < len(data):
            data[at] ^= xor
    path = tmp_path_factory.getbasetemp() / "fuzzed.gguf"
    path.write_bytes(bytes(data))
    try:
        GgufFile(path)
    except CheckpointError:
        pass


PARSE = """
import json, sys, tracemalloc
from cakemp.checkpoint.gguf import GgufFile
from cakemp.errors import CheckpointError
tracemalloc.start()
try:
    GgufFile(sys.argv[1])
    error = None
except CheckpointError as e:
    error = str(e)
print(json.dumps({"error": error, "peak": tracemalloc.get_traced_memory()[1]}))
"""


def parsed_in_a_process(path: Path) -> tuple[str | None, int]:
    """Parse `path` in a fresh process: its CheckpointError's text or None, and the peak bytes Python
    allocated meanwhile (tracemalloc: every object the metadata became)."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PARSE, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    return outcome["error"], outcome["peak"]


def _written_metadata(path: Path, arrays: dict[str, object]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (values, kind) in arrays.items():
        writer.add_array(key, values) if kind is None else writer.add_key_value(key, values, gguf.GGUFValueType.ARRAY,
                                                                                  sub_type=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@needs_gguf
def test_metadata_arrays_take_about_their_bytes_in_memory(tmp_path):
    """gguf-py's writer: two u16 arrays of 2^20 numbers past 256 and a vocabulary of 2^18 short tokens
    (~7 MiB in all). Parsed, they take under twice the file's bytes (as Python lists: ~20 times), and
    read back as written."""
    import gguf

    numbers = [300 + i % 60000 for i in range(1 << 20)]
    tokens = [f"t{i}" for i in range(1 << 18)]
    path = _written_metadata(tmp_path / "arrays.gguf", {
        "a.numbers": (numbers, gguf.GGUFValueType.UINT16), "b.numbers": (numbers, gguf.GGUFValueType.UINT16),
        "tokenizer.ggml.tokens": (tokens, None)})
    error, peak = parsed_in_a_process(path)
    assert error is None and peak < 2 * path.stat().st_size
    metadata = GgufFile(path).metadata
    assert metadata["a.numbers"] == numbers and metadata["tokenizer.ggml.tokens"] == tokens
    assert metadata["tokenizer.ggml.tokens"][-1] == tokens[-1] and len(metadata["tokenizer.ggml.tokens"]) == 1 << 18


@needs_gguf
def test_a_header_of_many_small_arrays_is_refused_naming_the_file_and_key(tmp_path):
    """An array of 2^20 one-number arrays (16 MiB written) would take ~5 times that as objects: refused
    by the key that takes the parsed metadata past the file's size plus the slack, with the peak
    allocation within that bound."""
    from cakemp.checkpoint.gguf import METADATA_SLACK

    path = _written_metadata(tmp_path / "nested.gguf", {"general.nested": ([[7]] * (1 << 20), None)})
    error, peak = parsed_in_a_process(path)
    assert error is not None and str(path) in error and "metadata general.nested takes the parsed metadata past" in error
    assert "\n" not in error and peak < path.stat().st_size + 2 * METADATA_SLACK
