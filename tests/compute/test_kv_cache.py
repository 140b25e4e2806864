"""KVCache: growth by doubling, exact growth under a tight budget, limits, freeing."""

import pytest
import torch

from cakemp.compute.kv_cache import MIN_CAPACITY, KVCache
from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded

PER_POSITION = 2 * 2 * 8 * 4  # K+V x 2 kv heads x 8 dims x f32


def cache(**kwargs):
    return KVCache(kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"), **kwargs)


def test_first_use_allocates_min_capacity_then_doubles_keeping_rows():
    """A slot starts at MIN_CAPACITY positions, doubles when outgrown, and keeps its rows."""
    c = cache(max_context=4096)
    slot = c.reserve(1, {0: 10})[0]
    assert slot.capacity == MIN_CAPACITY and c.nbytes() == MIN_CAPACITY * PER_POSITION
    slot.k[:, :, :10] = torch.arange(10.0)[None, None, :, None]
    slot.length = 10
    grown = c.reserve(1, {0: MIN_CAPACITY + 1})[0]
    assert grown.capacity == 2 * MIN_CAPACITY and grown.length == 10
    assert torch.equal(grown.k[0, 1, :10, 3], torch.arange(10.0))
    assert c.nbytes() == 2 * MIN_CAPACITY * PER_POSITION


def test_growth_is_capped_at_the_context_limit():
    """Doubling never allocates past max_context."""
    c = cache(max_context=300)
    c.reserve(1, {0: 10})
    assert c.reserve(1, {0: MIN_CAPACITY + 1})[0].capacity == 300


def test_context_limit_is_named():
    """An end past max_context is ContextLimitExceeded, and nothing is allocated."""
    c = cache(max_context=100)
    with pytest.raises(ContextLimitExceeded, match="position 100 .* limit of 100"):
        c.reserve(1, {0: 50, 1: 101})
    assert c.nbytes() == 0 and c.session_count() == 0


def test_tight_budget_grows_exactly_instead_of_doubling():
    """When doubling would pass the budget but the needed positions fit, exactly those are allocated."""
    c = cache(max_context=4096, budget_bytes=100 * PER_POSITION)
    assert c.reserve(1, {0: 60, 1: 40})[0].capacity == 60
    assert c.nbytes() == 100 * PER_POSITION


def test_budget_refusal_is_all_or_nothing():
    """A reservation that cannot fit allocates none of its slots and leaves other sessions alone; the
    refusal gives its figures in units a person reads (262 positions of 128 bytes need 32.8 KiB)."""
    c = cache(max_context=4096, budget_bytes=2 * MIN_CAPACITY * PER_POSITION)
    c.reserve(1, {0: 5})
    with pytest.raises(CacheBudgetExceeded, match=r"^the KV cache would need 32\.8 KiB more but only 32\.0 KiB "
                                                  r"of this device's 64\.0 KiB budget is left$"):
        c.reserve(2, {0: 5, 1: MIN_CAPACITY + 1})
    assert c.nbytes() == MIN_CAPACITY * PER_POSITION and c.session_count() == 1


def test_clear_frees_only_that_session():
    """clear() returns a session's bytes to the budget and forgets its lengths."""
    c = cache(max_context=4096)
    c.reserve(1, {0: 5, 3: 5})[3].length = 5
    c.reserve(2, {0: 5})
    c.clear(1)
    assert c.nbytes() == MIN_CAPACITY * PER_POSITION and c.length(1, 3) == 0 and c.session_count() == 1


class Spare:
    """What prefix reuse holds inside the budget, as the cache sees it."""

    def __init__(self, held: int):
        self.held, self.asked = held, []

    def nbytes(self) -> int:
        return self.held

    def release(self, nbytes: int) -> None:
        self.asked.append(nbytes)
        self.held = max(0, self.held - nbytes)


def test_the_spare_gives_back_room_before_growth_falls_short_of_doubling():
    """With the budget held by the spare, a slot's growth asks it for the room doubling needs and
    grows doubled; once neither the budget nor the spare has room left, a session is refused."""
    c = cache(max_context=4096, budget_bytes=2 * MIN_CAPACITY * PER_POSITION)
    c.spare = Spare(2 * MIN_CAPACITY * PER_POSITION)
    assert c.room() == 0
    assert c.reserve(1, {0: 10})[0].capacity == MIN_CAPACITY
    assert c.spare.asked == [MIN_CAPACITY * PER_POSITION] and c.room() == 0
    c.spare = Spare(MIN_CAPACITY * PER_POSITION - 10 * PER_POSITION)  # holds all but 10 positions' room
    assert c.reserve(2, {0: 5})[0].capacity == MIN_CAPACITY and c.spare.held == 0 and c.room() == 0
    with pytest.raises(CacheBudgetExceeded):
        c.reserve(3, {0: 1})


def test_slots_detached_and_attached_leave_and_rejoin_the_count():
    """detach takes a session's slots out of the count, attach puts them (or copies) back under
    another session, copied slots holding the first rows."""
    c = cache(max_context=4096)
    slot = c.reserve(1, {0: 10, 1: 10})[0]
    slot.k[:, :, :10] = 1.0
    slot.length = 10
    kv, linear = c.detach(1)
    assert c.nbytes() == 0 and c.session_count() == 0 and set(kv) == {0, 1} and linear == {}
    c.attach(2, kv)
    assert c.nbytes() == 2 * MIN_CAPACITY * PER_POSITION and c.length(2, 0) == 10
    copies = c.copied(2, [0], 6, 300)
    assert copies[0].capacity == 300 and copies[0].length == 6 and torch.equal(copies[0].k[:, :, :6], slot.k[:, :, :6])
    c.resume(2, [0, 1], 4, {})
    assert c.length(2, 0) == c.length(2, 1) == 4
    with pytest.raises(ValueError):
        c.attach(2, copies)
