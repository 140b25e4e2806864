"""BufferBudget: frames wait for room in order, never partly held, and cancelled waits give back what they had."""

from __future__ import annotations

import asyncio

import pytest

from cakemp.front.buffer_budget import BufferBudget


def test_takes_within_capacity_return_at_once_and_report_what_is_held():
    """Takes that fit do not wait; every change is reported."""
    reported = []

    async def main():
        budget = BufferBudget(100, on_change=reported.append)
        await budget.take(60)
        await budget.take(40)
        budget.give(60)
        assert budget.held == 40

    asyncio.run(main())
    assert reported == [60, 100, 40]


def test_a_take_past_capacity_waits_and_later_ones_queue_behind_it():
    """A frame that does not fit waits for room; a small one after it waits its turn (no starvation)."""

    async def main():
        budget = BufferBudget(100)
        await budget.take(90)
        big = asyncio.create_task(budget.take(50))
        small = asyncio.create_task(budget.take(5))
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        budget.give(90)
        await asyncio.wait_for(asyncio.gather(big, small), 5)
        assert budget.held == 55

    asyncio.run(main())


def test_a_cancelled_wait_leaves_nothing_held_and_lets_the_next_in():
    """A connection closed while it waits gives up its place; the one behind it is served."""

    async def main():
        budget = BufferBudget(100)
        await budget.take(80)
        first = asyncio.create_task(budget.take(50))
        second = asyncio.create_task(budget.take(20))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.wait_for(second, 5)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.held == 100

    asyncio.run(main())


def test_more_than_the_whole_budget_is_refused():
    """A take that could never be granted raises instead of waiting forever."""

    async def main():
        with pytest.raises(ValueError):
            await BufferBudget(10).take(11)

    asyncio.run(main())
