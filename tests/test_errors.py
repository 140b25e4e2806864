"""The error tree: three branches that say who is at fault, and one ipc code per class that declares one."""

from __future__ import annotations

import re

import pytest

from cakemp import errors
from cakemp.errors import ErrorCode, error_code, error_from

DECLARED = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
BRANCHES = (errors.PeerFault, errors.NodeFault, errors.StartupError)


def test_every_error_sits_in_exactly_one_branch():
    """Every class but the root, the branches and the RequestError mark is a PeerFault, a NodeFault
    or a StartupError, and never two of them: the tree's claim to say who is at fault holds."""
    leaves = [e for e in DECLARED if e not in (errors.CakempError, errors.RequestError, *BRANCHES)]
    assert len(leaves) > 10
    assert {e.__name__: sum(issubclass(e, branch) for branch in BRANCHES) for e in leaves} == {
        e.__name__: 1 for e in leaves}


def test_request_errors_are_a_mark_across_the_fault_branches():
    """A bad request keeps the connection (WorkerError) whoever is at fault; a protocol error closes it."""
    assert not issubclass(errors.RequestError, errors.CakempError)
    assert issubclass(errors.BadTensor, errors.RequestError) and issubclass(errors.BadTensor, errors.PeerFault)
    assert issubclass(errors.CacheBudgetExceeded, errors.RequestError)
    assert issubclass(errors.CacheBudgetExceeded, errors.NodeFault)
    assert not issubclass(errors.ProtocolError, errors.RequestError)


def test_the_docstring_draws_every_class():
    """The tree in the module docstring names every class declared here, each once."""
    drawn = re.findall(r"[├└]── (\w+)", errors.__doc__)
    assert sorted(drawn) == sorted(e.__name__ for e in DECLARED if e not in (errors.CakempError, errors.RequestError))


def test_every_code_is_declared_by_one_class():
    """Each ErrorCode is some class's own `code`, and no two classes declare the same one."""
    owners = {code: [e for e in DECLARED if vars(e).get("code") is code] for code in ErrorCode}
    assert {code: len(classes) for code, classes in owners.items()} == {code: 1 for code in ErrorCode}


@pytest.mark.parametrize("error, code", [
    (errors.UnknownLayer("x"), ErrorCode.UNKNOWN_LAYER),
    (errors.BadTensor("x"), ErrorCode.BAD_TENSOR),
    (errors.ContextLimitExceeded("x"), ErrorCode.CONTEXT_LIMIT),
    (errors.CacheBudgetExceeded("x"), ErrorCode.CACHE_BUDGET),
    (errors.PositionGap("x"), ErrorCode.POSITION_GAP),
    (errors.DeviceLost("x"), ErrorCode.DEVICE_LOST),
    (errors.BadOps("x"), ErrorCode.BAD_OPS),
    (errors.SessionExpired("x"), ErrorCode.SESSION_EXPIRED),
    (errors.InternalError("x"), ErrorCode.INTERNAL),
    (errors.OutOfMemory("x"), ErrorCode.OUT_OF_MEMORY),
    (errors.BadRequest("x"), ErrorCode.BAD_REQUEST),
    (errors.CheckpointError("x"), ErrorCode.CHECKPOINT),
    (errors.ConfigError("x"), ErrorCode.CONFIG),
    (RuntimeError("x"), ErrorCode.INTERNAL),
])
def test_errors_travel_as_codes_and_come_back_as_the_same_class(error, code):
    """Each error of cakemp's tree has its code and is rebuilt as that class; anything else is INTERNAL,
    rebuilt as InternalError."""
    assert error_code(error) == code
    back = error_from(code, "message")
    assert str(back) == "message"
    if code is ErrorCode.INTERNAL:
        assert type(back) is errors.InternalError
    else:
        assert type(back) is type(error)


@pytest.mark.parametrize("error, code", [
    (errors.RecurrentRewind("x"), ErrorCode.POSITION_GAP),
    (errors.SetupError("x"), ErrorCode.INTERNAL),
    (errors.ProtocolError("x"), ErrorCode.INTERNAL),
    (SystemExit(3), ErrorCode.INTERNAL),  # a foreign exception with a `code` of its own
])
def test_a_class_without_a_code_of_its_own_travels_as_its_nearest_ancestors(error, code):
    """error_code walks the MRO: the most specific class that declares a code gives it; no order to keep."""
    assert error_code(error) == code


def test_a_code_is_declared_once():
    """Declaring a code another class declares already fails at once, when the class is defined."""
    with pytest.raises(TypeError, match="UNKNOWN_LAYER"):
        type("Twice", (errors.BadRequest,), {"code": ErrorCode.UNKNOWN_LAYER})
