"""PackedWeight: MKL's packed GEMM gives F.linear's products for any batch size, kept only where it costs
little memory, or weights stay plain."""

import pytest
import torch
import torch.nn.functional as F

from cakemp.compute.runner import BlockRunner
from cakemp.demo.synthetic import write_checkpoint
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


@needs_mkl
def test_a_matrix_is_kept_packed_only_where_that_costs_at_most_a_tenth_more():
    """A [28672, 4096] matrix (Llama-3-8B's fused gate/up) is kept packed alone, its packed buffer at most
    1.1x its plain bytes; a [256, 256] one, whose packed buffer would hold 20x its bytes, stays plain.
    (MKL's padding depends on the CPU: Llama-3-8B's [6144, 4096] q/k/v packs to 1.09x on one Xeon and
    1.12x on another, so the test takes the shape with the most room.)"""
    big = torch.randn(28672, 4096)
    kept = packed.packed_or_plain(big)
    assert isinstance(kept, packed.PackedWeight) and kept.shape == big.shape
    assert [name for name, part in vars(kept).items() if isinstance(part, torch.Tensor)] == ["packed"]
    assert kept.packed.nbytes <= packed.MAX_GROWTH * big.nbytes
    x = torch.randn(1, 3, 4096)
    assert_close(linear(x, kept), F.linear(x, big))
    small = torch.randn(256, 256)
    assert packed.packed_or_plain(small) is small
    assert packed.PackedWeight.create(small).packed.nbytes > 10 * small.nbytes


@needs_mkl
def test_a_batching_runners_weights_on_the_demos_shape_hold_their_plain_bytes(tmp_path):
    """The demo's checkpoint in f32, loaded as a batching CPU device loads it (pack_weights), holds what
    the plain weights hold: none of its small matrices is worth MKL's packed layout."""
    write_checkpoint(tmp_path)
    layers = [f"model.layers.{i}" for i in range(6)]
    plain, batching = (BlockRunner.load(tmp_path, layers, "cpu", torch.float32, pack_weights=pack).weight_bytes
                       for pack in (False, True))
    assert batching == plain
