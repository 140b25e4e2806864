"""The front bounds an image component's token ids: a text of more than MAX_TOKENS ids, or more than
MAX_TOKEN_ROWS rows of them, is a BadTensor (answered WorkerError) before any device sees it."""

from __future__ import annotations

import pytest

from cakemp.checkpoint.image.archs import MAX_TOKEN_ROWS, MAX_TOKENS
from cakemp.errors import BadTensor
from cakemp.front.component_admission import ComponentAdmission
from cakemp.wire import DType, LayerOp, LayerOps, RawTensor

ADMISSION = ComponentAdmission.for_arch("sd", ["clip", "unet", "vae"])


def ids(rows: int, length: int) -> RawTensor:
    return RawTensor(bytes(rows * length * 4), DType.U32, (rows, length))


def test_token_ids_within_the_bounds_pass():
    ADMISSION.check(ids(MAX_TOKEN_ROWS, MAX_TOKENS), LayerOps.of([LayerOp("clip", 0, 0)]))


@pytest.mark.parametrize(("rows", "length"), [(1, MAX_TOKENS + 1), (MAX_TOKEN_ROWS + 1, 1), (1, 0), (0, 1)])
def test_token_ids_past_the_bounds_are_refused(rows, length):
    with pytest.raises(BadTensor, match=r"takes token ids \[b, L\]"):
        ADMISSION.check(ids(rows, length), LayerOps.of([LayerOp("clip", 0, 0)]))
