"""The chat template child's kill timer: firing just after a rendering answered, that answer is given
and the next rendering gets a child afresh instead of failing on the killed one; and it times the
rendering alone, not the child's start before it."""

from __future__ import annotations

import asyncio
import sys
import time

from tokenizers import Tokenizer, models

from cakemp.master.chat import ChatTemplate
from cakemp.master.template_process import TemplateProcess

SECONDS = 0.5
MESSAGES = [{"role": "user", "content": "hi"}]


class LateLines:
    """A child's stdout whose next line is handed over only once the kill timer has fired: the answer is
    in, but the rendering has not yet cancelled the timer."""

    def __init__(self, stdout, late_s: float):
        self.stdout, self.late_s = stdout, late_s

    def readline(self) -> bytes:
        line = self.stdout.readline()
        time.sleep(self.late_s)
        return line

    def close(self) -> None:
        self.stdout.close()


def test_a_child_slow_to_start_costs_its_first_rendering_none_of_its_time(tmp_path, monkeypatch):
    """The child's interpreter starts 2 x SECONDS late (a loaded machine): its first rendering, timed
    from its ready line, still has its SECONDS."""
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f'#!/bin/sh\nsleep {2 * SECONDS}\nexec "{sys.executable}" "$@"\n')
    slow_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow_python))
    template = ChatTemplate("{% for m in messages %}<{{ m.content }}>{% endfor %}", {}, Tokenizer(models.BPE()))
    with TemplateProcess(template, SECONDS, 1 << 20) as process:
        assert asyncio.run(process.render(MESSAGES)) == "<hi>"


def test_a_timer_firing_right_after_the_answer_fails_neither_it_nor_the_next_rendering():
    template = ChatTemplate("{% for m in messages %}<{{ m.content }}>{% endfor %}", {}, Tokenizer(models.BPE()))
    with TemplateProcess(template, SECONDS, 1 << 20) as process:
        child = process._child
        child.stdout = LateLines(child.stdout, 2 * SECONDS)
        first = asyncio.run(process.render(MESSAGES))
        killed = child.wait(10)
        second = asyncio.run(process.render(MESSAGES))
    assert (first, second) == ("<hi>", "<hi>")
    assert killed is not None and process._child is not child
