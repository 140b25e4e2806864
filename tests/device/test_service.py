"""DeviceService, the device process's work, run in-process on a real runner: hops as they arrive
(one Hops message, decoded from its frames), the scheduler's steps, and what each sends on."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from cakemp.compute.runner import BlockRunner
from cakemp.device import fault
from cakemp.device.scheduler import Scheduler
from cakemp.device.service import DeviceService
from cakemp.errors import ConfigError
from cakemp.ipc import Activation, Clear, Done, End, ErrorCode, Failure, Hop, Hops, Op, Stage, decode, encode
from cakemp.ipc.spec import DeviceSpec
from cakemp.wire import DType
from tests.support.tolerance import assert_close

LAYERS = ("model.layers.2", "model.layers.3")
GENERATION = 4
# Another session holding state on the device: a long prompt is cut to the prefill budget, as a shared
# device cuts it (alone, it would run whole).
ANOTHER = frozenset({999})


@pytest.fixture
def service(checkpoint):
    spec = DeviceSpec(1, None, LAYERS, str(checkpoint), "f32", "ipc://unused", max_context=32)
    return DeviceService.load(spec, generation=GENERATION)


def raw(x: torch.Tensor, wire=DType.F32) -> bytes:
    return x.to({DType.F32: torch.float32, DType.F16: torch.float16}[wire]).reshape(-1).view(torch.uint8).numpy().tobytes()


def forward(x: torch.Tensor, ops, session=1, request_id=1, wire=DType.F32, data=None, rest=(), chunk=0, chunks=1,
            device=1, generation=GENERATION) -> tuple[Hop, bytes]:
    stages = (Stage.of(device, generation, tuple(ops)), *rest)
    data = raw(x, wire) if data is None else bytes(data)
    return Hop(session, request_id, wire, len(data), chunk, chunks, tuple(x.shape), stages), data


def received(message: Hops) -> Hops:
    """`message` as a device receives it: decoded from its frames, each writable (a ZeroMQ frame's buffer is)."""
    return decode([bytearray(frame) for frame in encode(message)])


class Reply(NamedTuple):
    item: Hop | Activation | Failure
    data: bytes
    device: int | None  # where it goes: None for the front

    @property
    def message(self) -> str:
        return self.data.decode()


def step(service: DeviceService, *hops: tuple[Hop, bytes], prefill_chunk: int = 128) -> list[Reply | None]:
    """The hops sent as one Hops message (as the device receives it: decoded from its frames), run
    through a scheduler to the end: each hop's reply, in order (None for a hop dropped)."""
    message = received(Hops(tuple(hop for hop, _ in hops), b"".join(data for _, data in hops)))
    tasks = service.tasks(message)
    scheduler = Scheduler(32, prefill_chunk)
    for task in tasks:
        scheduler.add(task)
    replies = {}
    while scheduler:
        for onward in service.run_step(scheduler.next_step(live=ANOTHER).pieces).onward:
            if isinstance(onward.item, Failure):
                scheduler.drop(onward.task)
            replies[onward.task.hop.request_id, onward.task.session] = Reply(onward.item, bytes(onward.data),
                                                                             onward.device)
    return [replies.get((hop.request_id, hop.session)) for hop, _ in hops]


def answer(service: DeviceService, hop: tuple[Hop, bytes], prefill_chunk: int = 128) -> Reply:
    (reply,) = step(service, hop, prefill_chunk=prefill_chunk)
    return reply


def tensor(reply: Reply) -> torch.Tensor:
    return torch.frombuffer(bytearray(reply.data), dtype=torch.float32).view(reply.item.shape)


def test_the_last_stage_answers_the_front_like_the_runner(service, checkpoint):
    """Ops naming layers by index give the runner's own output for those layers, as F32 bytes, with the KV bytes."""
    x = torch.randn(1, 4, 64)
    reply = answer(service, forward(x, [Op(0, 0, 2), Op(1, 0, 3)], request_id=5))
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    expected = runner.run(9, x, runner.ops([("model.layers.2", 0, 2), ("model.layers.3", 0, 3)]))
    item = reply.item
    assert isinstance(item, Activation) and (item.request_id, item.dtype, item.shape) == (5, DType.F32, (1, 4, 64))
    assert reply.device is None and item.nbytes == len(reply.data) == 4 * 64 * 4
    assert item.kv == (service.runner.kv_bytes(),) and item.kv[0] > 0
    torch.testing.assert_close(tensor(reply), expected)


def test_the_hops_of_one_message_are_converted_at_once_and_answered_each_like_the_runner(service, checkpoint):
    """Three sessions' hops in one message become views of one converted buffer, run as one batch
    (one Batch of 3 requests, 1 + 2 + 3 tokens), and each answer equals the runner's for that session."""
    xs = [torch.randn(1, t, 64) for t in (1, 2, 3)]
    message = received(Hops(tuple(forward(x, [Op(0, 0, 2)], session=s, request_id=s)[0]
                                  for s, x in enumerate(xs, 1)), b"".join(raw(x) for x in xs)))
    tasks = service.tasks(message)
    assert len({task.x.untyped_storage().data_ptr() for task in tasks}) == 1
    stepped = service.run_step(_pieces(tasks))
    assert [(batch.requests, batch.tokens) for batch in stepped.batches] == [(3, 6)]
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    for onward, x in zip(stepped.onward, xs, strict=True):
        expected = runner.run(onward.task.session, x, runner.ops([("model.layers.2", 0, 2)]))
        got = torch.frombuffer(bytearray(onward.data), dtype=torch.float32).view(onward.item.shape)
        assert_close(got, expected)


def _pieces(tasks):
    scheduler = Scheduler(32, 128)
    for task in tasks:
        scheduler.add(task)
    return scheduler.next_step().pieces


def test_a_stage_with_more_to_run_is_handed_on_with_the_rest_of_the_route(service):
    """With a later stage on the route, the result becomes a Hop for that stage, its chunk and KV report kept."""
    later = Stage.of(0, 2, (Op(0, 0, 4),))
    x = torch.randn(1, 3, 64)
    reply = answer(service, forward(x, [Op(0, 0, 2)], request_id=6, rest=(later,), chunk=1, chunks=3))
    item = reply.item
    assert isinstance(item, Hop) and reply.device == 0
    assert (item.session, item.request_id, item.stages, item.chunk, item.chunks) == (1, 6, (later,), 1, 3)
    assert item.kv == (service.runner.kv_bytes(),) and item.nbytes == len(reply.data) == 3 * 64 * 4


def test_a_route_for_another_process_or_device_is_dropped(service):
    """A hand-off naming an earlier generation of this device (its process died since), or another device, is dropped."""
    x = torch.randn(1, 2, 64)
    assert step(service, forward(x, [Op(0, 0, 2)], generation=GENERATION - 1),
                forward(x, [Op(0, 0, 2)], session=2, device=0)) == [None, None]
    assert len(service.runner.sessions()) == 0


def test_an_f16_request_is_answered_in_f16(service):
    """The reply keeps the request's wire dtype whatever the device computes in."""
    reply = answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], wire=DType.F16))
    assert reply.item.dtype == DType.F16 and len(reply.data) == 2 * 64 * 2


def test_chunks_in_order_equal_the_whole_prompt(service, checkpoint):
    """A prompt sent as three chunks at their offsets gives the unchunked result within f32 tolerance."""
    x = torch.randn(1, 10, 64)
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    expected = runner.run(9, x, runner.ops([("model.layers.2", 0, 2), ("model.layers.3", 0, 3)]))
    parts = []
    for chunk, (start, end) in enumerate(((0, 4), (4, 7), (7, 10))):
        reply = answer(service, forward(x[:, start:end], [Op(0, start, 2), Op(1, start, 3)], chunk=chunk, chunks=3))
        parts.append(tensor(reply))
    assert_close(torch.cat(parts, dim=1), expected)


def test_a_prompt_cut_here_equals_the_whole_prompt_and_is_answered_once(service, checkpoint):
    """A 10-token prompt on a device cutting by 4 runs as three pieces (4, 3 and 3 tokens, one a step)
    and is answered once, with the unchunked result within f32 tolerance."""
    x = torch.randn(1, 10, 64)
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    expected = runner.run(9, x, runner.ops([("model.layers.2", 0, 2), ("model.layers.3", 0, 3)]))
    message = received(Hops((forward(x, [Op(0, 0, 2), Op(1, 0, 3)])[0],), raw(x)))
    scheduler = Scheduler(32, 4)
    (task,) = service.tasks(message)
    scheduler.add(task)
    steps = []
    while scheduler:
        stepped = service.run_step(scheduler.next_step(live=ANOTHER).pieces)
        steps.append(([batch.tokens for batch in stepped.batches], stepped.onward))
    assert [tokens for tokens, _ in steps] == [[4], [3], [3]] and [len(onward) for _, onward in steps] == [0, 0, 1]
    (onward,) = steps[-1][1]
    assert onward.item.shape == (1, 10, 64)
    assert_close(tensor(Reply(onward.item, bytes(onward.data), None)), expected)


def test_a_hop_s_rows_are_named_by_its_own_received_bytes_for_prefix_reuse(checkpoint):
    """A hop in the compute dtype comes with its received bytes (prefix reuse names its rows by them,
    no copy back from the device); one in another dtype, or on a device without reuse, does not. A prompt cut here names each piece
    by its own rows: a second prompt sharing the first 16 of 20 rows reuses those 16 alone (the first
    piece's bytes for every piece would have named all 20 alike) and answers what a fresh prefill does."""
    spec = DeviceSpec(1, None, LAYERS, str(checkpoint), "f32", "ipc://unused")
    service = DeviceService.load(spec, generation=GENERATION)
    x = torch.randn(1, 20, 64)
    ops = [Op(0, 0, 2), Op(1, 0, 3)]
    own, other = service.tasks(received(Hops((forward(x, ops)[0], forward(x, ops, session=2, wire=DType.F16)[0]),
                                             raw(x) + raw(x, DType.F16))))
    assert bytes(own.data) == raw(x) and other.data is None
    off = DeviceService.load(dataclasses.replace(spec, prefix_reuse=False), generation=GENERATION)
    assert off.tasks(received(Hops((forward(x, ops)[0],), raw(x))))[0].data is None  # nothing names rows: none held
    answer(service, forward(x, ops), prefill_chunk=4)
    service.handle(Clear(1, 2))
    y = torch.cat([x[:, :16], torch.randn(1, 4, 64)], dim=1)
    again = tensor(answer(service, forward(y, ops, request_id=3), prefill_chunk=4))
    report = service.prefix_report()
    assert (report.hits, report.tokens) == (1, 16)
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32)
    assert_close(again, runner.run(9, y, runner.ops([("model.layers.2", 0, 2), ("model.layers.3", 0, 3)])))


def test_a_prompt_cut_here_that_fails_part_way_says_part_of_it_ran_and_runs_no_further(service):
    """Past the context limit (32) in its third piece, a 40-token prompt cut by 16 is answered once
    with the failure, marked as having run in part here (the session's state, which its earlier pieces
    changed, is then dropped by the front); its pieces run no more."""
    reply = answer(service, forward(torch.randn(1, 40, 64), [Op(0, 0, 2)]), prefill_chunk=16)
    assert isinstance(reply.item, Failure) and reply.item.code == ErrorCode.CONTEXT_LIMIT and reply.item.ran == 1
    whole = answer(service, forward(torch.randn(1, 40, 64), [Op(0, 0, 2)], request_id=2))
    assert whole.item.code == ErrorCode.CONTEXT_LIMIT and whole.item.ran == 0


@pytest.mark.parametrize("make, code, words", [
    (lambda x: forward(x, [Op(0, 31, 2)]), ErrorCode.POSITION_GAP, "31"),
    (lambda x: forward(torch.randn(1, 33, 64), [Op(0, 0, 2)]), ErrorCode.CONTEXT_LIMIT, "32"),
])
def test_requests_that_cannot_be_served_become_failures(service, make, code, words):
    """A request this session's state cannot serve is answered with a Failure carrying the error's code
    and what was wrong."""
    reply = answer(service, make(torch.randn(1, 2, 64)))
    assert isinstance(reply.item, Failure) and reply.item.code == code and words in reply.message, reply


@pytest.mark.parametrize("make", [
    lambda x: forward(x, [Op(2, 0, 2)]),  # a layer index this device does not have
    lambda x: forward(x, [Op(0, 0, 2)], data=bytearray(7)),
    lambda x: (Hop(1, 1, DType.F64, 2 * 64 * 8, 0, 1, (1, 2, 64), (Stage.of(1, GENERATION, (Op(0, 0, 2),)),)),
               bytes(2 * 64 * 8)),
    lambda x: forward(torch.randn(1, 2, 32), [Op(0, 0, 2)]),
], ids=["layer-index", "byte-count", "dtype", "hidden-size"])
def test_requests_that_break_the_contract_are_internal_failures(service, make):
    """What the front's admission refuses (a layer index, byte count, dtype or shape no master may send)
    reaching a device is the node's bug: an INTERNAL failure naming no detail, and the service serves on."""
    bad, good = step(service, make(torch.randn(1, 2, 64)), forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], session=2))
    assert isinstance(bad.item, Failure) and bad.item.code == ErrorCode.INTERNAL, bad
    assert bad.message == "internal error on device cpu:1"
    assert isinstance(good.item, Activation)  # its neighbour in the message
    assert isinstance(answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], request_id=9)).item, Activation)


def test_once_a_chunk_fails_the_later_chunks_get_the_same_failure_unrun(service):
    """Chunk 0 of 3 fails (a position gap); chunks 1 and 2 are answered with that failure without running,
    after which the request id is forgotten."""
    x = torch.randn(1, 2, 64)
    first = answer(service, forward(x, [Op(0, 5, 2)], request_id=8, chunks=3))
    assert isinstance(first.item, Failure) and first.item.code == ErrorCode.POSITION_GAP
    later = [answer(service, forward(x, [Op(0, 0, 2)], request_id=8, chunk=c, chunks=3)) for c in (1, 2)]
    assert [(f.item.code, f.message, f.item.chunk) for f in later] == [
        (first.item.code, first.message, 1), (first.item.code, first.message, 2)]
    assert len(service.runner.sessions()) == 0  # chunk 1 at position 0 would have created the session
    assert isinstance(answer(service, forward(x, [Op(0, 0, 2)], request_id=8)).item, Activation)


def test_a_fault_that_is_not_a_request_error_names_no_class_or_detail(service, monkeypatch):
    """An unexpected exception inside the runner becomes an INTERNAL failure naming only the device."""

    def broken(*args):
        raise RuntimeError("/secret/path/libtorch.so: boom at 0x7f00")

    monkeypatch.setattr(service.runner, "_run", broken)
    reply = answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)]))
    assert isinstance(reply.item, Failure) and reply.item.code == ErrorCode.INTERNAL
    assert reply.message == "internal error on device cpu:1"


def test_a_long_run_of_ops_reports_progress_between_slices(service):
    """40 ops run in slices; between them the service reports the request as in progress (the watchdog's
    sign of life), and the result equals the same ops without interruption."""
    reported = []
    service.progress = reported.append
    x = torch.randn(1, 1, 64)
    ops = [Op(i % 2, 0, 2 + i % 2) for i in range(40)]
    reply = answer(service, forward(x, ops, request_id=11))
    assert isinstance(reply.item, Activation)
    assert reported and set(reported) == {11}
    expected = service.runner.run(2, x, service.runner.ops([(LAYERS[op.layer], 0, op.block_idx) for op in ops]))
    assert_close(tensor(reply), expected)


def test_clear_and_end_report_the_sessions_left(service):
    """Done after Clear and End carries the device's session count and KV bytes."""
    for session in (1, 2):
        assert isinstance(answer(service, forward(torch.randn(1, 3, 64), [Op(0, 0, 2)], session=session)).item,
                          Activation)
    both = service.runner.kv_bytes()
    cleared = service.handle(Clear(1, 7))
    assert isinstance(cleared, Done) and cleared.request_id == 7
    assert (cleared.sessions, cleared.kv_bytes) == (1, both // 2)  # the sessions are the same size
    assert service.handle(End(1, 8)).sessions == 1  # session 1 was gone already
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
    """The service whose runner raises the given stand-in error while computing its next request only."""
    compute = service.runner._run

    def fail_once(error):
        def raising(*args):
            monkeypatch.setattr(service.runner, "_run", compute)
            raise error
        monkeypatch.setattr(service.runner, "_run", raising)
        return service
    return fail_once


def test_a_poisoning_error_fails_its_request_and_marks_the_process_to_end(failing):
    """An illegal memory access is answered as DeviceLost (the device restarts) and sets `poisoned`."""
    service = failing(RuntimeError(ILLEGAL_ACCESS))
    reply = answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], request_id=3))
    assert isinstance(reply.item, Failure) and (reply.item.request_id, reply.item.code) == (3, ErrorCode.DEVICE_LOST)
    assert "illegal memory access" in reply.message and "restarts" in reply.message
    assert service.poisoned is not None and "illegal memory access" in service.poisoned


@pytest.mark.parametrize("error, code, words", [
    (torch.OutOfMemoryError(OUT_OF_MEMORY), ErrorCode.OUT_OF_MEMORY,
     "out of memory on cpu: CUDA out of memory. Tried to allocate 2.00 GiB"),
    (ValueError("a bug"), ErrorCode.INTERNAL, "internal error on device cpu:1"),
])
def test_other_faults_fail_their_request_and_the_device_serves_on(failing, error, code, words):
    """Out of memory (in two sentences, not torch's paragraph) and ordinary failures leave the process serving."""
    service = failing(error)
    reply = answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)]))
    assert isinstance(reply.item, Failure) and reply.item.code == code and reply.message == words, reply
    assert service.poisoned is None
    assert isinstance(answer(service, forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], request_id=2)).item, Activation)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA finds no GPU")
def test_a_gpu_this_process_cannot_use_is_a_configuration_error(checkpoint):
    """A GPU device whose GPU CUDA cannot find (or a torch without CUDA) fails its load with ConfigError (exit 78)."""
    with pytest.raises(ConfigError, match="cuda:7: cannot use GPU 7"):
        DeviceService.load(DeviceSpec(0, "7", LAYERS, str(checkpoint), "f32", "ipc://unused"))


def test_a_failure_copying_one_result_to_the_host_fails_that_hop_alone(service, monkeypatch):
    """The copy of a result to the host is where an asynchronous CUDA error surfaces: raised there for
    session 1's result (so for the step's results copied together too), it becomes session 1's
    INTERNAL failure, session 2's hop of the same step is answered, and run_step does not raise."""
    from cakemp.compute import tensors

    to_bytes = tensors.to_bytes

    def failing(y, dtype):
        if y.numel() != 2 * 64:  # session 1's hop carries 3 tokens, session 2's 2
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return to_bytes(y, dtype)

    monkeypatch.setattr(tensors, "to_bytes", failing)
    first, second = step(service, forward(torch.randn(1, 3, 64), [Op(0, 0, 2)], session=1, request_id=1),
                         forward(torch.randn(1, 2, 64), [Op(0, 0, 2)], session=2, request_id=2))
    assert isinstance(first.item, Failure) and first.item.request_id == 1
    assert isinstance(second.item, Activation) and second.item.request_id == 2


def test_goodbye_keeps_a_sessions_rows_and_a_closed_connection_frees_them(checkpoint):
    """Clear retires the session's rows (the next prompt re-sending them is answered from them, and the
    report says so once); End frees them; reuse off keeps nothing."""
    spec = DeviceSpec(1, None, LAYERS, str(checkpoint), "f32", "ipc://unused")
    service = DeviceService.load(spec, generation=GENERATION)
    x = torch.randn(1, 20, 64)
    first = tensor(answer(service, forward(x, [Op(0, 0, 2), Op(1, 0, 3)])))
    assert isinstance(service.handle(Clear(1, 2)), Done) and len(service.runner.sessions()) == 0
    retired = service.prefix_report().retired_bytes
    assert retired > 0 and service.prefix_report() is None  # nothing changed since
    again = tensor(answer(service, forward(x, [Op(0, 0, 2), Op(1, 0, 3)], request_id=3)))
    report = service.prefix_report()
    assert torch.equal(again, first) and (report.hits, report.tokens) == (1, 20)
    service.handle(Clear(1, 4))
    service.handle(End(1, 5))
    report = service.prefix_report()
    assert (report.retired_bytes, report.kept_bytes) == (0, 0)
    off = DeviceService.load(dataclasses.replace(spec, prefix_reuse=False), generation=GENERATION)
    assert off.runner.prefixes is None and off.prefix_report() is None
