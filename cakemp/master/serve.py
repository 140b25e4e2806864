"""`cakemp serve`'s process: open the generator, then run the API on uvicorn until a signal stops it.

uvicorn serves the Starlette app (`api.py`) on a socket bound here, so that port 0 gets a free
port and the "api listening" event can name it before the first request. uvicorn's own logging
goes through cakemp's (its records are the root logger's); its access log is off, since every
request is logged once by the API with its figures.

Prompts are encoded in threads and chat templates rendered in a child process
(`prompt_encoding.py`, `template_process.py`), so the event loop never tokenizes nor renders.

What a peer can hold is bounded: a connection whose request has not arrived whole is one of at
most 64, for at most 10 seconds, and one that stops reading its answer is aborted after 10
seconds of blocked writes (`connection_guard.py`); uvicorn answers 503 past
`MOST_CONNECTIONS` connections or requests in progress.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import socket
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from cakemp import heap, log
from cakemp.address import parse_address
from cakemp.errors import ConfigError
from cakemp.master.generator import Generator
from cakemp.master.openai_request import RequestReader
from cakemp.master.prompt_encoding import PromptEncoder
from cakemp.master.template_process import TemplateProcess

try:
    import uvicorn

    from cakemp.master.api import Api
    from cakemp.master.connection_guard import GuardedH11Protocol, IncompleteConnections
except ImportError as exc:  # the optional extra is missing
    _MISSING: ImportError | None = exc
else:
    _MISSING = None

RENDERING_BODIES = 4  # the longest chat rendering, in request bodies: the template's markers around each message
MOST_CONNECTIONS = 256  # uvicorn's limit_concurrency: connections and requests in progress, each counted


@dataclass(frozen=True)
class ServeOptions:
    """`cakemp serve`'s flags, past those naming the cluster."""

    address: str  # host:port
    model_id: str
    max_tokens: int
    repeat_penalty: float
    repeat_last_n: int
    max_body_bytes: int
    max_waiting: int
    chat_template_seconds: float
    share_prefixes_across_clients: bool = False


async def serve_api(opening: Awaitable[Generator], options: ServeOptions) -> None:
    """Open the generator (`opening`), then serve the API over it until SIGINT or SIGTERM."""
    if _MISSING is not None:
        opening.close()  # never awaited: nothing was opened
        raise ConfigError(f"cakemp serve needs the serve extra (pip install 'cakemp[serve]'): {_MISSING}")
    try:
        listener = _listen(options.address)
    except ConfigError:
        opening.close()
        raise
    with listener:
        await _serve(await opening, listener, options)


async def _serve(generator: Generator, listener: socket.socket, options: ServeOptions) -> None:
    async with generator, _reader(generator, options) as reader:
        api = Api(generator, reader, max_body_bytes=options.max_body_bytes, max_waiting=options.max_waiting,
                  share_prefixes_across_clients=options.share_prefixes_across_clients)
        guarded = functools.partial(GuardedH11Protocol, guard=IncompleteConnections())
        config = uvicorn.Config(api.app(), http=guarded, limit_concurrency=MOST_CONNECTIONS, log_config=None,
                                access_log=False, lifespan="off")
        host, port = listener.getsockname()[:2]
        frozen = heap.freeze_loaded()  # torch, the tokenizer, the web stack: out of every garbage collection
        log.get_logger().info("api listening", url=f"http://{host}:{port}/v1", port=port, model=options.model_id,
                              max_concurrent=generator.max_concurrent, frozen_objects=frozen)
        _ignore_repeated_signals()
        await uvicorn.Server(config).serve(sockets=[listener])


@contextlib.asynccontextmanager
async def _reader(generator: Generator, options: ServeOptions) -> AsyncIterator[RequestReader]:
    """The request reader over `generator`'s tokenizer and chat template, its threads and child process
    ended with it."""
    prompts = PromptEncoder(generator.tokenizer, generator.context_length)
    templates = None if generator.chat is None else \
        TemplateProcess(generator.chat, options.chat_template_seconds, RENDERING_BODIES * options.max_body_bytes)
    try:
        yield RequestReader(options.model_id, prompts, templates, options.max_tokens, options.repeat_penalty,
                            options.repeat_last_n)
    finally:
        prompts.close()
        if templates is not None:
            templates.close()


def _ignore_repeated_signals() -> None:
    """uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again under the handler
    it found, to die by it. That second delivery finds these, which ignore it: `cakemp serve` then
    closes its connections and exits 0, as `cakemp run` does."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)


def _listen(address: str) -> socket.socket:
    """A TCP socket listening on `address` (host:port), bound before any weights are loaded."""
    host, port = parse_address(address)
    try:
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from None
    return listener
