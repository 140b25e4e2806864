"""`cakemp run` keeping 8-bit weights of one scale a row int8 on an f32 CPU device (the default),
over TCP, against HF's layers computing the dequantization of the same weights (what the node
computes with --dequantize-4bit), within the bound derived for the kept path's bf16 roundings
(tests/support/tolerance.py: INT8_KEPT_REL).

* a GPTQ 8-bit Llama of one group a row (group_size -1, random asymmetric codes), against HF's
  layers over the project's own dequantization of it (checked against GPTQModel's in
  tests/model/test_gptq.py): every matrix kept int8;
* an MLX affine 8-bit Llama in groups of 64, written by mx.quantize, against MLX's dequantization:
  q/k/v, o and gate/up (64 inputs, one group a row) kept int8, down_proj (two groups) dequantized.
A prompt and 8 decode steps, a prompt in 3-token chunks, and a 70-token prompt (past the 19 rows
from which a product takes the bf16 tiles instead of the int8 kernel), and the bytes the device
reports its weights hold against the zero-config master's rule (checkpoint/resident.py).
"""

from __future__ import annotations

from tests.node.test_int4_node import KEPT, check_kept, check_weight_bytes
from tests.support.checkpoints import make_checkpoint
from tests.support.int4_checkpoints import gptq_reference, random_gptq
from tests.support.quantized import mlx_checkpoint, needs_mlx
from tests.support.quantized_node import start
from tests.support.tolerance import INT8_KEPT_REL


def served_against_reference(path, reference, tmp_path) -> None:
    node = start(path, tmp_path, flags=KEPT)
    try:
        check_kept(node, path, reference, INT8_KEPT_REL)
        check_weight_bytes(node, path)
    finally:
        assert node.stop() == 0


def test_a_gptq_8_bit_checkpoint_of_one_group_kept_int8_matches_its_dequantization_within_the_bound(tmp_path):
    plain = make_checkpoint(tmp_path / "plain", "llama")
    path = random_gptq(tmp_path / "gptq", plain, -1, bits=8)
    served_against_reference(path, gptq_reference(tmp_path / "reference", plain, path), tmp_path)


@needs_mlx
def test_an_mlx_8_bit_checkpoint_keeps_its_one_group_rows_int8_within_the_bound(tmp_path):
    path, reference = mlx_checkpoint(tmp_path / "mlx", "llama", bits=8, group_size=64)
    served_against_reference(path, reference, tmp_path)
