"""`cakemp serve`: an OpenAI-compatible HTTP API over one `Generator` (its workers and local layers).

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, or not),
GET /v1/models, /health and /metrics (serve_metrics.py). Up to the generator's `max_concurrent`
requests run at once in its step loop (step_loop.py), each its own Cake session on its own
connections; the rest wait their turn in arrival order, at most `max_waiting` of them; past that
they are refused with 503. Each generation ends with Goodbye on its connections, so a worker
keeping retired prefixes answers a later request's shared prefix (a system prompt, a chat's
history) from what it kept: only a request of the same isolation key (its `user` or
`cache_salt`), since one client's latency would otherwise tell another's prompt. Requests that
name neither share nothing, unless `share_prefixes_across_clients` (connections.py).

A connection that broke (a worker restarted, say) fails the requests on it with 502; its set is
closed and the next request dials afresh. A worker's own error answer (WorkerError) fails its
request alone and leaves the connections as they are.

A generation runs as a task of its own, never inside the HTTP handler: a client that leaves
(mid-stream, or while it waits for a whole answer) sets the generation's `halt`, the generation
leaves the step loop after the step in flight and says Goodbye, its place taken by the next.
Request bodies are bounded (`max_body_bytes`, 413 past it); every refusal is OpenAI's JSON error
object. A client that leaves while its request is read (rendered, tokenized) cancels that reading.
What a connection may hold before and after its request is bounded by `connection_guard.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from cakemp import log
from cakemp.errors import CakempError
from cakemp.master.generator import Generation, Generator
from cakemp.master.openai_request import ApiError, Completion, RequestReader
from cakemp.master.serve_metrics import ServeMetrics
from cakemp.master.stop_strings import StopStrings

MAX_BODY_BYTES = 1 << 20
MAX_WAITING = 16
SHARED_KEY = ("shared",)  # the isolation key of every request naming none, with --share-prefixes-across-clients


class Job:
    """One request's generation: its text pieces as they come, then its outcome."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self.id = f"{'chatcmpl' if completion.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"  # OpenAI's, and the log's
        self.halt = asyncio.Event()  # set by a stop sequence reached, or a client gone
        self.generation: Generation | None = None
        self.error: ApiError | None = None  # what failed the generation, as its client is told
        self._stops = StopStrings(completion.stops)
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()  # None: the generation ended

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "stop" at an end token or a stop sequence, else "length"."""
        ended = self.generation is not None and self.generation.stopped_at_eos
        return "stop" if ended or self._stops.reached else "length"

    async def texts(self) -> AsyncIterator[str]:
        """The answer's text as it comes; raises what failed the generation, at its end."""
        while (piece := await self._pieces.get()) is not None:
            yield piece
        if self.error is not None:
            raise self.error

    async def text(self) -> str:
        return "".join([piece async for piece in self.texts()])

    def on_text(self, piece: str) -> None:
        """The generator's text callback: shows what no stop sequence may still claim, halts at one."""
        shown = self._stops.feed(piece)
        if self._stops.reached:
            self.halt.set()
        if shown:
            self._pieces.put_nowait(shown)

    def ended(self, generation: Generation | None, error: ApiError | None) -> None:
        self.generation, self.error = generation, error
        if error is None and (tail := self._stops.flush()):
            self._pieces.put_nowait(tail)
        self._pieces.put_nowait(None)


class Turns:
    """The cluster's generations: up to the generator's `max_concurrent` at once (its step loop), then
    up to `max_waiting` more in arrival order; past that 503."""

    def __init__(self, generator: Generator, max_waiting: int = MAX_WAITING,
                 share_prefixes_across_clients: bool = False) -> None:
        self.generator = generator
        self.max_waiting = max_waiting
        # The isolation key of requests that name none: shared by all of them, or none (each its own).
        self.keyless = SHARED_KEY if share_prefixes_across_clients else None
        self.admitted = 0  # requests running or waiting
        loop = generator.loop
        self.metrics = ServeMetrics(lambda: len(loop.running), lambda: len(loop.waiting), loop.spent)
        self._tasks: set[asyncio.Task] = set()  # strong references to the running generations

    @property
    def broken(self) -> bool:
        """Whether a connection broke and none was dialed since (the next request dials afresh)."""
        return self.generator.pool.broken

    def start(self, completion: Completion) -> Job:
        """`completion`'s generation, started (or queued); 503 when too many already wait."""
        if self.admitted >= self.generator.max_concurrent + self.max_waiting:
            raise ApiError(503, f"{self.max_waiting} requests already wait for the cluster; try again later",
                           type="server_error", code="overloaded")
        job = Job(completion)
        self.admitted += 1
        task = asyncio.create_task(self._generate(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _generate(self, job: Job) -> None:
        c, started = job.completion, time.perf_counter()
        generation, error = None, None
        try:
            generation = await self.generator.generate(c.prompt, c.max_tokens, c.sampling, on_text=job.on_text,
                                                       halt=job.halt, isolation=c.isolation or self.keyless,
                                                       on_token_time=self.metrics.token)
        except Exception as exc:  # the request's failure, told to its client; the server goes on
            error = _failure(exc, job.id)
            self.metrics.errors.inc(status=str(error.status))
        finally:
            self.admitted -= 1
            job.ended(generation, error)
        if generation is not None:
            self.metrics.prompt_tokens.inc(len(c.prompt))
            log.get_logger().info("request served", id=job.id, kind=c.kind, prompt_tokens=len(c.prompt),
                                  completion_tokens=len(generation.tokens), finish=job.finish_reason,
                                  halted=generation.halted, waited=round(generation.waited, 3),
                                  seconds=round(time.perf_counter() - started, 3))


class EventStream:
    """An ASGI response of server-sent events; the client leaving (or a write failing) halts the job."""

    def __init__(self, events: AsyncIterator[str], job: Job) -> None:
        self.events, self.job = events, job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(_halt_when_gone(receive, self.job))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache")]})
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client left while we wrote
        finally:
            self.job.halt.set()
            watcher.cancel()


async def _halt_when_gone(receive: Receive, job: Job) -> None:
    """Halts `job` when its client disconnects (read once its request body has been)."""
    await _gone(receive)
    job.halt.set()


async def _gone(receive: Receive) -> None:
    """Returns when the client disconnects (read once its request body has been)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client left while its request was read (its chat rendered, its prompt tokenized)."""


async def _unless_gone(reading: Awaitable[Completion], receive: Receive) -> Completion:
    """`reading`'s completion, or ClientGone when the client leaves first. Reading is cancelled then: a
    rendering or tokenizing still waiting for its thread (behind other clients') never runs, so requests
    sent and abandoned cost no more than the one in progress."""
    read, gone = asyncio.ensure_future(reading), asyncio.create_task(_gone(receive))
    try:
        await asyncio.wait((read, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not read.done()
        if left:
            read.cancel()
    if left:
        raise ClientGone
    return read.result()


class Api:
    """The routes, over one generator's turns."""

    def __init__(self, generator: Generator, reader: RequestReader, *, max_body_bytes: int = MAX_BODY_BYTES,
                 max_waiting: int = MAX_WAITING, share_prefixes_across_clients: bool = False) -> None:
        self.reader = reader
        self.turns = Turns(generator, max_waiting, share_prefixes_across_clients)
        self.max_body_bytes = max_body_bytes

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self._endpoint(self.reader.chat), methods=["POST"]),
                  Route("/v1/completions", self._endpoint(self.reader.text), methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    async def models(self, request: Request) -> JSONResponse:
        model = {"id": self.reader.model_id, "object": "model", "created": 0, "owned_by": "cakemp"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.reader.model_id, "requests": self.turns.admitted,
                             "connections": "broken: the next request reconnects" if self.turns.broken else "ok"})

    async def metrics(self, request: Request) -> Response:
        metrics = self.turns.metrics
        return Response(metrics.render(), media_type=metrics.content_type)

    def _endpoint(self, read: Callable[[object], Awaitable[Completion]]) -> Callable[[Request], Awaitable[object]]:
        async def endpoint(request: Request) -> object:
            try:
                job = self.turns.start(await _unless_gone(read(await self._body(request)), request.receive))
            except ClientGone:  # nobody to answer, and nothing counted: its reading was dropped
                return Response(status_code=400)
            except ApiError as exc:
                self.turns.metrics.errors.inc(status=str(exc.status))
                return _error(exc)
            answer = Answer(job, self.reader.model_id)
            if job.completion.stream:
                return EventStream(answer.events(), job)
            watcher = asyncio.create_task(_halt_when_gone(request.receive, job))
            try:
                return await answer.response()
            finally:
                watcher.cancel()
        return endpoint

    async def _body(self, request: Request) -> object:
        """The request's JSON, read no further than `max_body_bytes`."""
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            raise ApiError(413, f"request bodies are limited to {self.max_body_bytes} bytes")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise ApiError(413, f"request bodies are limited to {self.max_body_bytes} bytes")
        except ClientDisconnect:  # it left, or was closed (connection_guard.py), before its body arrived
            raise ApiError(400, "the client left before its request body arrived") from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # not UTF-8 JSON, or nested past the parser's depth
            raise ApiError(400, "the request body is not a JSON document") from None


class Answer:
    """A job told to its client in OpenAI's shapes: one JSON object, or chunks as events."""

    def __init__(self, job: Job, model_id: str) -> None:
        self.job, self.model_id = job, model_id
        self.id = job.id
        self.created = int(time.time())
        self.chat = job.completion.kind == "chat"

    async def response(self) -> JSONResponse:
        try:
            text = await self.job.text()
        except ApiError as exc:  # the job's failure, raised at its end
            return _error(exc)
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": self.job.finish_reason}
        return JSONResponse({**self._envelope(chunk=False), "choices": [choice], "usage": self._usage()})

    async def events(self) -> AsyncIterator[str]:
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""}, None)
        try:
            async for piece in self.job.texts():
                yield self._chunk({"content": piece} if self.chat else piece, None)
        except ApiError as exc:  # the job's failure, raised at its end
            yield _event(exc.body())
            return
        yield self._chunk({} if self.chat else "", self.job.finish_reason)
        if self.job.completion.include_usage:
            yield _event({**self._envelope(chunk=True), "choices": [], "usage": self._usage()})
        yield "data: [DONE]\n\n"

    def _chunk(self, delta: dict | str, finish_reason: str | None) -> str:
        content = {"delta": delta} if self.chat else {"text": delta}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
        return _event({**self._envelope(chunk=True), "choices": [choice]})

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id}

    def _usage(self) -> dict:
        prompt = len(self.job.completion.prompt)
        completion = 0 if self.job.generation is None else len(self.job.generation.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(exc: Exception, request_id: str) -> ApiError:
    """A failed generation: the cluster's (a worker's error, a lost connection: 502) or a bug here (500).
    A 502 names no worker address nor error, which an unauthenticated client must not learn: the log
    has them, under the request's id, which the answer gives."""
    if isinstance(exc, CakempError | OSError):
        log.get_logger().error("request failed at the cluster", request=request_id, error=str(exc))
        return ApiError(502, f"a worker failed the request {request_id} (the server's log says why)",
                        type="server_error", code="cluster_error")
    log.get_logger().error("request failed here", request=request_id, error=repr(exc))
    return ApiError(500, "internal error", type="server_error")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return _error(ApiError(exc.status_code, f"{request.method} {request.url.path[:200]}: {exc.detail}"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.get_logger().error("request crashed", path=request.url.path, error=repr(exc))
    return _error(ApiError(500, "internal error", type="server_error"))
