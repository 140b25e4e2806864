"""A differential fuzz of the batched step: seeded random schedules (tests/support/schedules.py) of sessions
coming, decoding, sending prompt chunks, rewinding, asking for a position they have not reached or past
the runners' context limit, saying Goodbye and leaving, run step by step through runners that batch each
step differently, each request's answer checked against the same request run alone on a runner of its own.

The runners under test: the paged step (a CPU device's), the fixed-shape step a GPU captures as CUDA
graphs (run eagerly, and recorded and replayed with a graph's semantics: tests/support/cpu_graphs.py),
and the paged step with prefix reuse sharing blocks between sessions under a KV budget (new prompts
often repeat an earlier one's first rows, so that blocks are shared and copied on write), once under a
budget that holds all it is asked and once under one the sessions of three masters' addresses overfill.
An answer equals the one alone within tests/support/tolerance.py's f32 bound; a request the one alone
refuses is refused with the same error, and its neighbours in the step are answered as if it had not
been there. Under the tight budget a request may also be refused for room (the one alone, which has no
budget, is then not asked; a prompt at 0 so refused has ended its session's earlier rows, as a prompt at 0
does), or its session given up for another address's (it then starts afresh): what
is answered is still answered as alone, so a refusal or a give-up changed no state it should not have,
and the budget is never overdrawn. Without prefix reuse, the KV bytes held after each step are those of
the live sessions' positions.
"""

import random
from collections import Counter

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute import paged_step
from cakemp.compute.fair_share import GIVEN_UP
from cakemp.compute.kv_cache import BLOCK
from cakemp.compute.runner import BlockRunner, Request
from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded, PositionGap, RecurrentRewind
from cakemp.op import Op
from cakemp.sources import session_id
from tests.support import cpu_graphs
from tests.support.families import family_checkpoint
from tests.support.schedules import Schedule
from tests.support.tolerance import assert_close

LAYERS = [1, 2, 3]
STEPS = 40
MAX_CONTEXT = 96  # every session starts again below this
CONTEXT_LIMIT = 48  # the runners' --max-context: a session reaching it is refused alike until it leaves


@pytest.fixture(scope="module", params=["llama", "gemma3", "phi3", "qwen3_5", "qwen3_moe"])
def family(request, tmp_path_factory):
    """Plain Llama; Gemma 3's windows (4) and two rotaries; Phi-4-mini's partial longrope (switching
    factors past position 16) and window (5); Qwen3.5's linear-attention layers (1 and 2: a recurrence,
    which refuses a rewind; 3 full attention), whose steps no graph holds; Qwen3-MoE's experts routed
    per token of the whole step."""
    return family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


RUNNERS = {
    "paged": {},
    "paged-arrays": {},  # every step of decodes alone read from the tables as arrays (paged_step._ARRAYS_FROM)
    "graphed": {"graph_batch": 8},  # steps of more than 8 decodes, or with a chunk, take the paged step
    "graphed-replayed": {"graph_batch": 8},
    "shared-prefixes": {"prefix_reuse": True, "share_prefixes": True, "kv_budget_bytes": 8 << 20},
    # Overfilled by the live sessions of three addresses and their retired prefixes: requests refused for
    # room, retired prefixes given up for it, sessions past their address's share given up.
    "shared-prefixes-tight": {"prefix_reuse": True, "share_prefixes": True, "kv_budget_bytes": 80 << 10},
}
SOURCES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")  # the masters' addresses, session after session in turn


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_random_steps_answer_each_request_as_it_alone(family, kind, seed, monkeypatch):
    if kind == "graphed-replayed":
        cpu_graphs.install(monkeypatch)
    if kind == "paged-arrays":
        monkeypatch.setattr(paged_step, "_ARRAYS_FROM", 0)
    names = [ModelConfig.from_dir(family).layer_name(i) for i in LAYERS]
    tested = BlockRunner.load(family, names, "cpu", torch.float32, max_context=CONTEXT_LIMIT, **RUNNERS[kind])
    alone = BlockRunner.load(family, names, "cpu", torch.float32, max_context=CONTEXT_LIMIT)
    schedule = Schedule(random.Random(seed), tested.config.hidden_size, MAX_CONTEXT)
    outcomes = Counter()
    for _ in range(STEPS):
        asked = schedule.step()
        requests = [Request(_session(a.session), a.x, [Op(i, a.position, layer) for i, layer in enumerate(LAYERS)])
                    for a in asked]
        for request, result, one in zip(requests, tested.run_batch(requests), asked, strict=True):
            outcome = _as_alone(alone, request, result)
            outcomes[outcome] += 1
            if outcome == "answered":
                schedule.answered(one)
            elif schedule.ended(one, outcome):
                for runner in (tested, alone):
                    runner.free_session(request.session)
        for session, goodbye in schedule.leaving():
            for runner in (tested, alone):
                (runner.clear_session if goodbye else runner.free_session)(_session(session))
        if tested.cache.budget_bytes is not None:
            assert tested.cache.room() >= 0  # the budget never overdrawn
        if tested.prefixes is None and not any(tested.recurrent):
            # Each live session holds the blocks of its positions in each layer, no more (none of a refused
            # request, none past a rewind, none of a session gone).
            blocks = sum(-(-length // BLOCK) for length in schedule.cached.values()) * len(LAYERS)
            assert tested.kv_bytes() == blocks * tested.cache.bytes_per_block
    # The schedule did what it is for; only the tight budget refuses for room, and there it also gives sessions up.
    tight = kind == "shared-prefixes-tight"
    assert outcomes["answered"] > (1 if tight else 2) * STEPS and outcomes["refused"] > 0
    assert (outcomes["no room"] > 0 and outcomes["given up"] > 0) if tight else not (outcomes["no room"] or outcomes["given up"])
    if kind.startswith("graphed") and all(tested.capturable):  # (no graph holds a MoE or a linear layer)
        assert tested.graphs.made  # some steps took a graph
        assert kind == "graphed" or cpu_graphs.Recording.replays > 0
    if kind == "shared-prefixes":
        assert tested.prefixes.hits > 0


def _session(serial: int) -> int:
    """The id of the schedule's session `serial`, its master at one of SOURCES in turn (a budget's shares are theirs)."""
    return session_id(SOURCES[serial % len(SOURCES)], serial)


def _as_alone(alone: BlockRunner, request: Request, result: torch.Tensor | Exception) -> str:
    """How the tested runner's `result` for `request` compares with `alone`'s run of it (which has no budget,
    and is not asked where the tested runner had no room): "answered" as alone answers it, "refused" as alone
    refuses it, or, under a budget, refused for room ("no room") or with its session given up ("given up")."""
    if isinstance(result, CacheBudgetExceeded):
        return "given up" if str(result) == GIVEN_UP else "no room"
    try:
        expected = alone.run(request.session, request.x, request.ops)
    except (PositionGap, RecurrentRewind, ContextLimitExceeded) as e:
        assert type(result) is type(e), f"{result!r} where alone: {e!r}"
        return "refused"
    assert isinstance(result, torch.Tensor), f"{result!r} where alone it was answered"
    assert_close(result, expected)
    return "answered"
