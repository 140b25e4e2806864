"""BufferBudget: frames wait for room, never partly held, shared among sources (least held first, each
within its share), small frames passing from a reserve with a place per source, capped at its places;
cancelled waits give back what they had."""

from __future__ import annotations

import asyncio

import pytest

from cakemp.front.buffer_budget import SMALL_FRAME, BufferBudget

LARGE = 2 * SMALL_FRAME  # a frame that never comes from the reserve
A, A_SIBLING, B = "10.0.0.1", "::ffff:10.0.0.1", "10.0.0.2"  # the first two are one source
PLACES = 16  # sources that may hold a small frame of the reserve at once


def budget_of(capacity: int) -> BufferBudget:
    return BufferBudget(capacity, PLACES)


async def settled() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_takes_within_capacity_return_at_once_and_say_what_is_held():
    """Takes that fit do not wait; `held` follows every change."""
    held = []

    async def main():
        budget = budget_of(10 * LARGE)
        first = await budget.take(6 * LARGE, A)
        held.append(budget.held)
        await budget.take(4 * LARGE, A)
        held.append(budget.held)
        budget.give(first)
        held.append(budget.held)

    asyncio.run(main())
    assert held == [6 * LARGE, 10 * LARGE, 4 * LARGE]


def test_a_frame_is_granted_at_once_exactly_up_to_its_sources_share_and_the_capacity():
    """Two sources hold 3 LARGE each of 10 (a share of 5 each): a frame one byte past its source's
    share waits though the capacity has room, one reaching the share exactly is granted at once; with
    9 LARGE held, a new source's frame one byte past the capacity waits, one filling it is granted."""

    async def waits(take) -> bool:
        task = asyncio.create_task(take)
        await settled()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return not task.done() or task.cancelled()

    async def main():
        budget = budget_of(10 * LARGE)
        await budget.take(3 * LARGE, A)
        await budget.take(3 * LARGE, B)
        assert await waits(budget.take(2 * LARGE + 1, A))
        await asyncio.wait_for(budget.take(2 * LARGE, A), 0.01)
        await budget.take(LARGE, "10.0.0.3")
        assert await waits(budget.take(LARGE + 1, "10.0.0.4"))
        await asyncio.wait_for(budget.take(LARGE, "10.0.0.4"), 0.01)
        assert budget.held == 10 * LARGE

    asyncio.run(main())


def test_a_take_past_capacity_waits_and_later_ones_of_its_source_queue_behind_it():
    """A frame that does not fit waits for room; a later one of the same source waits its turn (no starvation)."""

    async def main():
        budget = budget_of(10 * LARGE)
        held = await budget.take(9 * LARGE, A)
        big = asyncio.create_task(budget.take(5 * LARGE, A))
        later = asyncio.create_task(budget.take(2 * LARGE, A_SIBLING))
        await settled()
        assert not big.done() and not later.done()
        budget.give(held)
        await asyncio.wait_for(asyncio.gather(big, later), 5)
        assert budget.held == 7 * LARGE

    asyncio.run(main())


def test_a_source_holding_nothing_is_served_before_one_that_holds_the_budget():
    """A source holds the whole budget and waits for more; another source's frame, asked later, gets
    the first bytes given back, ahead of the first source's own waiting frames."""

    async def main():
        budget = budget_of(4 * LARGE)
        stalled = [await budget.take(LARGE, A) for _ in range(4)]
        more = [asyncio.create_task(budget.take(LARGE, A)) for _ in range(3)]
        other = asyncio.create_task(budget.take(LARGE, B))
        await settled()
        budget.give(stalled[0])
        await asyncio.wait_for(other, 5)
        assert not any(task.done() for task in more)
        for task in more:
            task.cancel()

    asyncio.run(main())


def test_a_source_holding_bytes_takes_more_only_within_its_share():
    """Two sources hold 4 of 10 each: the share is 5, so A's next 2 waits though 2 are free, and B's next 1
    passes; A's goes once B holds nothing."""

    async def main():
        budget = budget_of(10 * LARGE)
        await budget.take(4 * LARGE, A)
        from_b = await budget.take(4 * LARGE, B)
        over = asyncio.create_task(budget.take(2 * LARGE, A))
        await settled()
        assert not over.done()
        again = await asyncio.wait_for(budget.take(LARGE, B), 5)
        budget.give(from_b)
        await settled()
        assert not over.done()  # A's 4 + 2 is still past its share of 5
        budget.give(again)  # B holds nothing: A's share is the whole budget
        await asyncio.wait_for(over, 5)

    asyncio.run(main())


def test_a_small_frame_passes_from_the_reserve_one_per_source_when_the_budget_is_spent():
    """The budget is spent and a large frame waits: a Hello-sized frame of another source still passes
    at once, from the reserve; that source's second one waits; the reserve is held beside the capacity."""

    async def main():
        budget = budget_of(2 * LARGE)
        held = [await budget.take(LARGE, A) for _ in range(2)]
        waiting = asyncio.create_task(budget.take(LARGE, A))
        hello = await asyncio.wait_for(budget.take(100, B), 5)
        assert budget.held == 2 * LARGE + 100
        second = asyncio.create_task(budget.take(100, B))
        await settled()
        assert not second.done() and not waiting.done()
        budget.give(hello)
        budget.give(held[0])
        budget.give(await asyncio.wait_for(second, 5))
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())


def test_a_cancelled_wait_leaves_nothing_held_and_lets_the_next_in():
    """A connection closed while it waits gives up its place; the one behind it is served."""

    async def main():
        budget = budget_of(10 * LARGE)
        await budget.take(8 * LARGE, A)
        first = asyncio.create_task(budget.take(5 * LARGE, B))
        second = asyncio.create_task(budget.take(2 * LARGE, B))
        await settled()
        first.cancel()
        await asyncio.wait_for(second, 5)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.held == 10 * LARGE

    asyncio.run(main())


def test_more_than_the_whole_budget_is_refused():
    """A take that could never be granted raises instead of waiting forever."""

    async def main():
        with pytest.raises(ValueError):
            await budget_of(10).take(11, A)

    asyncio.run(main())


def test_sixty_four_stalled_sources_holding_their_share_and_their_place_do_not_hold_up_another():
    """64 sources each hold a large frame's share of the spent budget and a small frame of the reserve,
    and each has more frames of both sizes waiting: a 65th source's small frames (a Hello, then a decode
    step) pass at once, each from its own place. (Before, one pool of 16 small frames, first come first
    served, was taken by the first 16 stalled sources and the 65th waited for one to be given back.)"""

    async def main():
        budget = BufferBudget(64 * LARGE, 128)
        sources = [f"10.1.0.{i}" for i in range(64)]
        [await budget.take(LARGE, source) for source in sources]
        for source in sources:
            await asyncio.wait_for(budget.take(SMALL_FRAME, source), 5)
        waiting = [asyncio.create_task(budget.take(size, source)) for source in sources for size in (LARGE, 100)]
        await settled()
        assert not any(task.done() for task in waiting)
        hello = await asyncio.wait_for(budget.take(100, "10.2.0.1"), 5)
        budget.give(hello)
        await asyncio.wait_for(budget.take(SMALL_FRAME, "10.2.0.1"), 5)
        assert budget.held == 64 * LARGE + 65 * SMALL_FRAME
        for task in waiting:
            task.cancel()

    asyncio.run(main())


def test_the_reserve_stays_capped_at_its_places_with_many_sources():
    """The budget is spent and 64 sources each ask for three small frames: at most PLACES of them are held
    past the capacity, one per source, and the rest wait until a place is given back."""

    async def main():
        budget = budget_of(2 * LARGE)
        held = [await budget.take(LARGE, A) for _ in range(2)]
        asked = [asyncio.create_task(budget.take(SMALL_FRAME, f"10.1.0.{i}")) for i in range(64) for _ in range(3)]
        await settled()
        granted = [task for task in asked if task.done()]
        assert len(granted) == PLACES and budget.held == 2 * LARGE + PLACES * SMALL_FRAME
        assert len({task.result().source for task in granted}) == PLACES
        budget.give(granted[0].result())
        await settled()
        assert sum(task.done() for task in asked) == PLACES + 1
        for task in asked:
            task.cancel()
        for one in held:
            budget.give(one)

    asyncio.run(main())


def test_many_waits_cancelled_at_once_leave_nothing_held():
    """Connections closed together while they wait (the node stopping, a frame timeout closing many): none
    of them is granted by another's leaving, and nothing stays held. (Before, the first to leave granted
    the next, already cancelled: an InvalidStateError, and its bytes held for good.)"""

    async def main():
        budget = budget_of(2 * LARGE)
        held = await budget.take(2 * LARGE, A)
        waiting = [asyncio.create_task(budget.take(LARGE, f"10.1.0.{i}")) for i in range(8)]
        await settled()
        for task in waiting:
            task.cancel()
        budget.give(held)  # room, before the cancelled waits have run to leave
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        assert budget.held == 0

    asyncio.run(main())
