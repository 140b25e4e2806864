"""A `cakemp serve` job's text at the generation's end: what the stop sequences held back (a possible
beginning of one) is sent once the generation ends without reaching one, at max_tokens or an end token."""

from __future__ import annotations

import asyncio

import pytest

from cakemp.master.api import Job
from cakemp.master.generator import Generation
from cakemp.master.openai_request import Completion
from cakemp.master.sampler import SamplingParams


def job_text(pieces: list[str], eos: bool) -> tuple[str, str]:
    """The text a job streams for `pieces`, its generation ending at an end token (`eos`) or its
    max_tokens, and its finish reason."""

    async def main():
        job = Job(Completion("text", (1, 2), len(pieces), SamplingParams(), ("</end>",), True, False))
        for piece in pieces:
            job.on_text(piece)
        job.ended(Generation((1, 2), tuple(range(len(pieces))), "".join(pieces), (0.0,) * len(pieces), eos), None)
        return await job.text(), job.finish_reason

    return asyncio.run(main())


@pytest.mark.parametrize("eos", [False, True], ids=["max_tokens", "end token"])
def test_the_text_held_back_for_a_stop_sequence_is_sent_when_the_generation_ends(eos):
    text, reason = job_text(["the answer ", "ends in </e"], eos)
    assert text == "the answer ends in </e"
    assert reason == ("stop" if eos else "length")


def test_a_stop_sequence_reached_cuts_the_text_before_it():
    assert job_text(["the answer ", "ends in </e", "nd> and more"], False) == ("the answer ends in ", "stop")
