"""PackedWeight: MKL's packed GEMM gives F.linear's products for any batch size, or weights stay plain."""

import pytest
import torch
import torch.nn.functional as F

from cakemp.model.linear import linear
from cakemp.model.weights import packed
from tests.support.tolerance import assert_close

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")


@needs_mkl
def test_packing_works_on_this_machine():
    assert packed.packing_works()


@needs_mkl
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
def test_packed_products_equal_plain_ones_for_any_batch(rows):
    """[1, rows, 96] x a packed [200, 96] weight, with and without bias, against F.linear."""
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    weight_packed = packed.PackedWeight.create(weight)
    assert weight_packed.shape == weight.shape
    x = torch.randn(1, rows, 96, generator=generator)
    assert_close(linear(x, weight_packed), F.linear(x, weight))
    assert_close(linear(x, weight_packed, bias), F.linear(x, weight, bias))
    strided = torch.randn(1, 2 * rows, 96, generator=generator)[:, ::2]  # a view, as a batch's split is
    assert_close(linear(strided, weight_packed), F.linear(strided, weight))


def test_only_f32_cpu_matrices_are_packed():
    assert not packed.packable(torch.randn(8, 8, dtype=torch.bfloat16))
    assert not packed.packable(torch.randn(8))
    assert packed.packable(torch.randn(8, 8)) == packed.packing_works()
