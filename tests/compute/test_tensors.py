"""Wire bytes + dtype tag ⇄ tensors inside a device process."""

from __future__ import annotations

import pytest
import torch

from cakemp.compute import tensors
from cakemp.errors import BadTensor, ConfigError
from cakemp.wire import DType


@pytest.mark.parametrize("dtype, wire", [(torch.float16, DType.F16), (torch.bfloat16, DType.BF16),
                                         (torch.float32, DType.F32)])
def test_bytes_and_tensors_round_trip_little_endian(dtype, wire):
    """A tensor's bytes read back as the same tensor, and it is written back as the same bytes."""
    x = torch.randn(1, 3, 8).to(dtype)
    data = x.reshape(-1).view(torch.uint8).numpy().tobytes()
    y = tensors.to_tensor(bytearray(data), wire, (1, 3, 8))
    assert y.dtype == dtype and torch.equal(y, x)
    assert bytes(tensors.to_bytes(y, wire)) == data


def test_a_writable_buffer_is_viewed_not_copied():
    """The tensor over a writable buffer shares its memory (the zmq frame is not copied again)."""
    buffer = bytearray(4 * 4)
    x = tensors.to_tensor(memoryview(buffer), DType.F32, (1, 1, 4))
    buffer[0:4] = torch.tensor([2.5]).numpy().tobytes()
    assert x[0, 0, 0].item() == 2.5


def test_to_bytes_casts_to_the_requests_dtype():
    """An f32 result goes back as F16 bytes when the request came as F16."""
    out = tensors.to_bytes(torch.tensor([[[1.5, -2.0]]]), DType.F16)
    assert bytes(out) == torch.tensor([1.5, -2.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [DType.U8, DType.U32, DType.I64, DType.F64, DType.F8E4M3])
def test_non_float_activation_dtypes_are_refused(dtype):
    """Only F16, BF16 and F32 are activations; anything else is BadTensor naming the dtype."""
    with pytest.raises(BadTensor, match=f"unsupported dtype {dtype.name}"):
        tensors.to_tensor(bytes(8 * dtype.itemsize), dtype, (1, 1, 8))


def test_a_byte_count_that_does_not_fit_the_shape_is_refused():
    """Data of the wrong size for its shape is BadTensor with both numbers."""
    with pytest.raises(BadTensor, match="12 bytes .* needs 16"):
        tensors.to_tensor(bytes(12), DType.F32, (1, 1, 4))


def test_compute_dtype_names():
    """--dtype names map to torch dtypes; others are ConfigError."""
    assert [tensors.compute_dtype(n) for n in ("f16", "bf16", "f32")] == [torch.float16, torch.bfloat16, torch.float32]
    with pytest.raises(ConfigError):
        tensors.compute_dtype("f64")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_raw_tensors_round_trip_with_their_wire_tag(dtype):
    """to_raw tags a tensor with its wire dtype and shape; from_raw reads the same values back."""
    x = torch.randn(1, 2, 8).to(dtype)
    raw = tensors.to_raw(x, tensors.wire_dtype(dtype))
    assert (raw.dtype, raw.shape) == (tensors.wire_dtype(dtype), (1, 2, 8))
    assert torch.equal(tensors.from_raw(raw), x)
    with pytest.raises(BadTensor, match="float64"):
        tensors.wire_dtype(torch.float64)
