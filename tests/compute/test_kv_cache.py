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
