"""The speedy codec walks the messages' declarations: no message is spelled anywhere but there."""

from __future__ import annotations

from pathlib import Path

import cakemp.wire
from cakemp.wire.messages import VARIANTS
from tests.support.spelling import identifiers

WIRE = Path(cakemp.wire.__file__).parent


def test_each_message_is_spelled_once_in_the_wire_package():
    """A message's class statement is the only place the wire package names it: the codec, the
    variant tables, the Message union and the exports are all derived from the declarations,
    so adding a field or a message there is the whole change."""
    spelled = identifiers(sorted(WIRE.glob("*.py")))
    assert {variant.cls.__name__: spelled[variant.cls.__name__] for variant in VARIANTS} == {
        variant.cls.__name__: 1 for variant in VARIANTS}


def test_the_variants_are_cakes_enum_at_each_revision():
    """The declaration order and `since` give both revisions' tag tables (docs/protocol.md, Messages): the two enums
    agree up to ModelDataDone, and V2 has ModelDataResume at tag 10 before WorkerReady and WorkerError."""
    names = {revision: [v.cls.__name__ for v in VARIANTS if v.since <= revision] for revision in cakemp.wire.Revision}
    common = ["Hello", "WorkerInfo", "SingleOp", "Batch", "TensorMessage", "Goodbye", "LayerAssignment",
              "LayerAssignmentAck", "ModelDataChunk", "ModelDataDone"]
    assert names[cakemp.wire.Revision.V1] == common + ["WorkerReady", "WorkerError"]
    assert names[cakemp.wire.Revision.V2] == common + ["ModelDataResume", "WorkerReady", "WorkerError"]
