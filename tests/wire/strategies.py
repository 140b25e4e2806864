"""Hypothesis strategies for every Cake message, valid at a given protocol revision, drawn from the
messages' own declarations (a field added there is generated here with no change)."""

from __future__ import annotations

import math
from typing import Annotated, get_args, get_origin, get_type_hints

from hypothesis import strategies as st

from cakemp.wire import DType, RawTensor, Revision
from cakemp.wire.messages import VARIANTS, Bound, Since

RUST_TYPES = {
    "u8": st.integers(0, 2**8 - 1),
    "u32": st.integers(0, 2**32 - 1),
    "usize": st.integers(0, 2**64 - 1),
    "u128": st.integers(0, 2**128 - 1),
    "bool": st.booleans(),
    "String": st.text(max_size=24),  # hypothesis never generates lone surrogates, so all encode
    "Vec<u8>": st.binary(max_size=64),
}


@st.composite
def raw_tensors(draw) -> RawTensor:
    """A tensor decode_payload accepts: a known dtype, as many bytes as its shape needs."""
    dtype = draw(st.sampled_from(DType))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    size = math.prod(shape) * dtype.itemsize
    return RawTensor(draw(st.binary(min_size=size, max_size=size)), dtype, shape)


def values(hint: object) -> st.SearchStrategy:
    """Any value a field annotated `hint` can carry."""
    if get_origin(hint) is Annotated:
        inner, *marks = get_args(hint)
        if any(isinstance(mark, Bound) for mark in marks):  # a bounded Vec: well within any bound
            return values(inner)
        return RUST_TYPES[next(mark for mark in marks if isinstance(mark, str))]
    if get_origin(hint) is tuple:
        return st.lists(values(get_args(hint)[0]), max_size=5).map(tuple)
    if hint is RawTensor:
        return raw_tensors()
    return instances(hint, Revision.V1)


def instances(cls: type, revision: Revision) -> st.SearchStrategy:
    """Any `cls` whose fields hold what their encoding can carry at `revision` (a field the
    revision lacks keeps its default)."""
    hints = get_type_hints(cls, include_extras=True)
    present = {name: hint for name, hint in hints.items()
               if not any(isinstance(mark, Since) and mark.revision > revision for mark in get_args(hint)[1:])}
    return st.builds(cls, **{name: values(hint) for name, hint in present.items()})


def declared(revision: Revision) -> list[type]:
    """The message classes that exist at `revision`."""
    return [variant.cls for variant in VARIANTS if variant.since <= revision]


def messages(revision: Revision) -> st.SearchStrategy:
    """Any message that exists at `revision`, with field values its encoding can carry."""
    return st.one_of([instances(cls, revision) for cls in declared(revision)])

