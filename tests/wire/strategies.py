"""Hypothesis strategies for every Cake message, valid at a given protocol revision."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from cakemp.wire import (
    Batch,
    DType,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
    ModelDataChunk,
    ModelDataDone,
    ModelDataResume,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    WorkerReady,
)

u32s = st.integers(0, 2**32 - 1)
u64s = st.integers(0, 2**64 - 1)
texts = st.text(max_size=24)  # hypothesis never generates lone surrogates, so all encode


@st.composite
def raw_tensors(draw) -> RawTensor:
    dtype = draw(st.sampled_from(DType))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    data = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    return RawTensor(data, dtype, shape)


def messages(revision: Revision) -> st.SearchStrategy:
    """Any message that exists at `revision`, with field values its encoding can carry."""
    variants = [
        st.just(Hello()),
        st.just(Goodbye()),
        st.just(ModelDataDone()),
        st.just(WorkerReady()),
        st.builds(WorkerInfo, texts, texts, texts, texts, texts, u64s, st.integers(0, 2**128 - 1)),
        st.builds(SingleOp, texts, raw_tensors(), u64s, u64s),
        st.builds(Batch, raw_tensors(), st.lists(st.builds(LayerOp, texts, u64s, u64s), max_size=5).map(tuple)),
        st.builds(TensorMessage, raw_tensors()),
        st.builds(LayerAssignment, st.lists(texts, max_size=5).map(tuple), texts),
        st.builds(LayerAssignmentAck, st.booleans()),
        st.builds(WorkerError, texts),
    ]
    if revision == Revision.V1:
        variants.append(st.builds(ModelDataChunk, texts, u64s, u64s, st.binary(max_size=64)))
    else:
        variants.append(st.builds(ModelDataChunk, texts, u64s, u64s, st.binary(max_size=64), st.booleans(), u32s))
        variants.append(st.builds(ModelDataResume, texts, u64s))
    return st.one_of(variants)
