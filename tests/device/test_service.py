"""DeviceService, the device process's request handling, run in-process on a real runner."""

from __future__ import annotations

import pytest
import torch

from cakemp.compute import tensors
from cakemp.compute.runner import BlockRunner
from cakemp.device import fault
from cakemp.device.service import DeviceService
from cakemp.device.spec import DeviceSpec
from cakemp.errors import ConfigError
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward, Op
from cakemp.wire import DType

LAYERS = ("model.layers.2", "model.layers.3")


@pytest.fixture
def service(checkpoint):
    return DeviceService.load(DeviceSpec(0, None, LAYERS, str(checkpoint), "f32", "ipc://unused", max_context=32))


def forward(x: torch.Tensor, ops, session=1, request_id=1, wire=DType.F32, data=None) -> Forward:
    return Forward(session, request_id, wire, tuple(x.shape), tuple(ops), data or bytearray(tensors.to_bytes(x, wire)))


def test_forward_runs_the_addressed_layers_like_the_runner(service, checkpoint):
    """Ops naming layers by index give the runner's own output for those layers, as F32 bytes."""
    x = torch.randn(1, 4, 64)
    reply = service.handle(forward(x, [Op(0, 0, 2), Op(1, 0, 3)], request_id=5))
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    expected = runner.forward(9, x, [("model.layers.2", 0, 2), ("model.layers.3", 0, 3)])
    assert isinstance(reply, Activation) and (reply.request_id, reply.dtype, reply.shape) == (5, DType.F32, (1, 4, 64))
    torch.testing.assert_close(tensors.to_tensor(bytearray(reply.data), reply.dtype, reply.shape), expected)


def test_an_f16_request_is_answered_in_f16(service):
    """The reply keeps the request's wire dtype whatever the device computes in."""
    reply = service.handle(forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], wire=DType.F16))
    assert reply.dtype == DType.F16 and len(bytes(reply.data)) == 2 * 64 * 2


@pytest.mark.parametrize("make, error, words", [
    (lambda x: forward(x, [Op(2, 0, 2)]), "UnknownLayer", "layer #2"),
    (lambda x: forward(x, [Op(0, 0, 2)], data=bytearray(7)), "BadTensor", "7 bytes"),
    (lambda x: Forward(1, 1, DType.F64, (1, 2, 64), (Op(0, 0, 2),), bytearray(2 * 64 * 8)), "BadTensor", "F64"),
    (lambda x: forward(torch.randn(1, 2, 32), [Op(0, 0, 2)]), "BadTensor", "64"),
    (lambda x: forward(x, [Op(0, 31, 2)]), "PositionGap", "31"),
    (lambda x: forward(torch.randn(1, 33, 64), [Op(0, 0, 2)]), "ContextLimitExceeded", "32"),
])
def test_requests_that_cannot_be_served_become_failures(service, make, error, words):
    """Each bad request is answered with a Failure naming the error class and what was wrong."""
    reply = service.handle(make(torch.randn(1, 2, 64)))
    assert isinstance(reply, Failure) and reply.error == error and words in reply.message, reply


def test_clear_and_end_report_the_sessions_left(service):
    """Done after Clear and End carries the device's session count and KV bytes."""
    for session in (1, 2):
        assert isinstance(service.handle(forward(torch.randn(1, 3, 64), [Op(0, 0, 2)], session=session)), Activation)
    cleared = service.handle(Clear(1, 7))
    assert isinstance(cleared, Done) and cleared.request_id == 7 and cleared.kv_bytes > 0
    service.handle(End(1, 8))
    last = service.handle(End(2, 9))
    assert (last.sessions, last.kv_bytes) == (0, 0)


ILLEGAL_ACCESS = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
                  "reported at some other API call, so the stacktrace below might be incorrect.")
OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                 "1.06 GiB is free. Of the allocated memory 76.10 GiB is allocated by PyTorch.")


@pytest.mark.parametrize("error, poisons", [
    (RuntimeError(ILLEGAL_ACCESS), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: misaligned address"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, ...)`"), True),
    (torch.OutOfMemoryError(OUT_OF_MEMORY), False),
    (RuntimeError("CUDA error: invalid configuration argument"), False),
    (ValueError("a bug"), False),
])
def test_sticky_cuda_errors_poison_the_context(error, poisons):
    """CUDA's sticky errors are told apart from out-of-memory and ordinary failures by what they say."""
    assert fault.poisons_context(error) is poisons


@pytest.fixture
def failing(service, monkeypatch):
    """The service whose runner raises the given stand-in error on its next forward only."""
    forward = service.runner.forward

    def fail_once(error):
        def raising(*args):
            monkeypatch.setattr(service.runner, "forward", forward)
            raise error
        monkeypatch.setattr(service.runner, "forward", raising)
        return service
    return fail_once


def test_a_poisoning_error_fails_its_request_and_marks_the_process_to_end(failing):
    """An illegal memory access is answered as DeviceLost (the device restarts) and sets `poisoned`."""
    service = failing(RuntimeError(ILLEGAL_ACCESS))
    reply = service.handle(forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], request_id=3))
    assert isinstance(reply, Failure) and (reply.request_id, reply.error) == (3, "DeviceLost")
    assert "illegal memory access" in reply.message and "restarts" in reply.message
    assert service.poisoned is not None and "illegal memory access" in service.poisoned


@pytest.mark.parametrize("error, kind, words", [
    (torch.OutOfMemoryError(OUT_OF_MEMORY), "RequestError",
     "out of memory on cpu: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (ValueError("a bug"), "ValueError", "ValueError: a bug"),
])
def test_other_faults_fail_their_request_and_the_device_serves_on(failing, error, kind, words):
    """Out of memory (in two sentences, not torch's paragraph) and ordinary failures leave the process serving."""
    service = failing(error)
    reply = service.handle(forward(torch.randn(1, 2, 64), [Op(0, 0, 2)]))
    assert isinstance(reply, Failure) and reply.error == kind and reply.message == words, reply
    assert service.poisoned is None
    assert isinstance(service.handle(forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], request_id=2)), Activation)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA finds no GPU")
def test_a_gpu_this_process_cannot_use_is_a_configuration_error(checkpoint):
    """A GPU device whose GPU CUDA cannot find (or a torch without CUDA) fails its load with ConfigError (exit 78)."""
    with pytest.raises(ConfigError, match="cuda:7: cannot use GPU 7"):
        DeviceService.load(DeviceSpec(0, "7", LAYERS, str(checkpoint), "f32", "ipc://unused"))
