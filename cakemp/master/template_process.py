"""A chat template rendered in a child process that `cakemp serve` stops when it runs too long or too big.

A template is code from a model repository, and the messages it renders are a client's: nested
loops or `'x' * 2**31` would hold a thread here for as long as they ran (a Python thread cannot
be stopped) and take this process's memory. So `cakemp serve` renders in a child (`python -m
cakemp.master.template_process`) that has only the template: it reads one JSON line of messages,
answers one JSON line with the text, and is killed and started afresh when an answer takes longer
than `seconds` (counted from the child's ready line: its start, the interpreter's and jinja2's, is
bounded apart, by STARTUP_S, so a rendering just after a start, or a restart, is not charged for it).
Its address space is capped (`MEMORY_BYTES`, where the platform has
RLIMIT_AS) and a rendering longer than `most_bytes` is refused there, before it travels back.
Renderings take the child one at a time, in a thread of their own: never the event loop, nor the
default executor's threads, which the step loop computes in (renderings waiting behind a slow one
would otherwise hold every one of those threads, and every client's next token with them). A
rendering cancelled before its turn (its client left) is never sent to the child.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cakemp.master.chat import ChatTemplate, Message, TemplateRefused, compile_template, render_template

MEMORY_BYTES = 512 << 20  # the child's address space: the interpreter and jinja2 take ~40 MiB of it
STARTUP_S = 60.0  # longest a child may take to start and compile the template: a machine that busy is failing
_READY = b'{"ready": true}\n'


class TemplateProcess:
    """`template` rendered in a child process, each rendering bounded by `seconds` and `most_bytes`."""

    def __init__(self, template: ChatTemplate, seconds: float, most_bytes: int) -> None:
        self.seconds = seconds
        self._setup = json.dumps({"source": template.source, "special_tokens": template.special_tokens,
                                  "most_bytes": most_bytes}) + "\n"
        self._one_at_a_time = ThreadPoolExecutor(1, "chat-template")  # a request and its answer, never interleaved
        self._child = self._start()
        self._started = False  # the child has said it is ready

    def __enter__(self) -> TemplateProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def render(self, messages: Sequence[Message]) -> str:
        """The template's text for `messages`; TemplateRefused when it refuses them, fails, or overruns."""
        line = json.dumps([dict(m) for m in messages]) + "\n"
        return await asyncio.get_running_loop().run_in_executor(self._one_at_a_time, self._render, line)

    def close(self) -> None:
        self._one_at_a_time.shutdown(cancel_futures=True)
        self._stop_child()

    def _stop_child(self) -> None:
        self._child.kill()
        try:
            with self._child:  # its pipes closed and the child reaped, now rather than when collected
                pass
        except BrokenPipeError:  # its stdin held bytes the killed child never read (reaped all the same)
            pass

    def _render(self, line: str) -> str:
        if not self._started:
            ready, _ = self._exchange(b"", STARTUP_S)
            if ready != _READY:
                self._restart()
                raise TemplateRefused("the chat template's process did not start")
            self._started = True
        answer, overran = self._exchange(line.encode(), self.seconds)
        if overran or not answer.endswith(b"\n"):
            # Killed, even just after it answered (the timer fired before it was cancelled), or dead: the
            # next rendering gets a child afresh, not the killed one.
            self._restart()
        if not answer.endswith(b"\n"):
            raise TemplateRefused(f"the chat template took longer than {self.seconds:g} s on these messages"
                                  if overran else "the chat template failed on these messages")
        reply = json.loads(answer)
        if "refused" in reply:
            raise TemplateRefused(reply["refused"])
        return reply["text"]

    def _exchange(self, line: bytes, seconds: float) -> tuple[bytes, bool]:
        """Write `line` to the child and read its next line, killing it past `seconds`: the line (b""
        if it died first), and whether it was killed."""
        overran = threading.Event()
        timer = threading.Timer(seconds, lambda: (overran.set(), self._child.kill()))
        timer.start()
        try:
            if line:
                self._child.stdin.write(line)
                self._child.stdin.flush()
            answer = self._child.stdout.readline()
        except OSError:  # the child is gone: killed by the timer, or dead of its own
            answer = b""
        finally:
            timer.cancel()
            timer.join()  # a kill already under way has finished: `overran` says whether the child was killed
        return answer, overran.is_set()

    def _restart(self) -> None:
        self._stop_child()
        self._child = self._start()
        self._started = False

    def _start(self) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        child.stdin.write(self._setup.encode())
        child.stdin.flush()
        return child


def _limit_memory() -> None:
    try:
        import resource
    except ImportError:  # Windows: the time limit still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def _answer(template: object, special_tokens: dict, most_bytes: int, line: str) -> dict:
    try:
        text = render_template(template, special_tokens, json.loads(line))
    except TemplateRefused as exc:
        return {"refused": str(exc)}
    except MemoryError:
        return {"refused": f"the chat template ran out of its {MEMORY_BYTES >> 20} MiB on these messages"}
    if len(text) > most_bytes or len(text.encode("utf-8", "surrogatepass")) > most_bytes:
        return {"refused": f"the chat template rendered more than {most_bytes} bytes for these messages"}
    return {"text": text}


def main() -> None:
    """The child: the setup line, then one answer line per messages line, until its input ends."""
    setup = json.loads(sys.stdin.readline())
    template = compile_template(setup["source"])
    _limit_memory()
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(_answer(template, setup["special_tokens"], setup["most_bytes"], line)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
