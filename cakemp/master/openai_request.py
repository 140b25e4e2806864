"""OpenAI request bodies read into what one generation needs, or refused as OpenAI refuses them.

`/v1/chat/completions` takes `messages` (rendered by the checkpoint's chat template) and
`/v1/completions` a `prompt` (text, encoded as `cakemp generate --raw` encodes it). Both take
`model` (the one served), `max_tokens` (`max_completion_tokens` too, for chat), `temperature`
(0: greedy), `top_p`, `stop` (up to 4 strings), `seed`, `stream` and
`stream_options.include_usage`, and `user` or `cache_salt` (the isolation key: only requests
that share it reuse each other's prefixes on the workers); `n` must be 1. Fields this API does not use are ignored, as
OpenAI-compatible servers do. Every refusal is an `ApiError`: a status and OpenAI's error object.

Reading is async because it never tokenizes nor renders on the event loop: prompts go to a
`PromptEncoder` (threads, and the refusal by bytes), chats to a `TemplateProcess` (a child).
Text that is not valid Unicode (a lone surrogate, which JSON can write) is a 400. `max_tokens`
past the server's is refused, not cut, as OpenAI and vLLM refuse what they would not generate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cakemp.errors import ConfigError
from cakemp.master.prompt_encoding import PromptEncoder, PromptTooLong
from cakemp.master.sampler import SamplingParams
from cakemp.master.template_process import TemplateProcess

MAX_STOPS = 4  # OpenAI's limit on `stop`
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    """A request refused: `status` and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Completion:
    """One request, read: its prompt's ids and how to generate after them."""

    kind: str  # "chat" (/v1/chat/completions) or "text" (/v1/completions)
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    isolation: tuple[str, ...] | None = None  # (user, cache_salt) when it names either: whose prefixes it may reuse


@dataclass(frozen=True)
class RequestReader:
    """Reads requests for `model_id`: prompts encoded by `prompts`, chats rendered by `templates` (None for
    a model without a chat template); `max_tokens`: the most a request may ask for, and what it gets when
    it names none."""

    model_id: str
    prompts: PromptEncoder
    templates: TemplateProcess | None
    max_tokens: int
    repeat_penalty: float = 1.1
    repeat_last_n: int = 128

    async def chat(self, body: object) -> Completion:
        body = self._common(body)
        if self.templates is None:
            raise ApiError(400, f"{self.model_id} has no chat template: use /v1/completions", param="messages")
        messages = _messages(body.get("messages"))
        try:
            text = await self.templates.render(messages)
        except ConfigError as exc:  # the template's own raise_exception, its failure, or its time or size bound
            raise ApiError(400, str(exc), param="messages") from None
        # The template writes the special tokens, so none are added (as transformers encodes a chat).
        prompt = await self._encode(text, "messages", add_special_tokens=False)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return self._completion("chat", body, prompt, limit)

    async def text(self, body: object) -> Completion:
        body = self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one prompt
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be one non-empty string", param="prompt")
        # With the tokenizer's own special tokens, as --raw.
        tokens = await self._encode(prompt, "prompt", add_special_tokens=True)
        return self._completion("text", body, tokens, body.get("max_tokens"))

    async def _encode(self, text: str, param: str, add_special_tokens: bool) -> tuple[int, ...]:
        try:
            return await self.prompts.encode(text, _utf8_length(text, param), add_special_tokens)
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None

    def _common(self, body: object) -> Mapping:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") != self.model_id:
            raise ApiError(404, f"the model {str(body.get('model'))[:200]!r} is not served here; "
                                f"this server serves {self.model_id!r}", param="model", code="model_not_found")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        return body

    def _completion(self, kind: str, body: Mapping, prompt: tuple[int, ...], limit: object) -> Completion:
        if not prompt:
            raise ApiError(400, "the prompt encodes to no tokens", param="messages" if kind == "chat" else "prompt")
        max_tokens = self._max_tokens(len(prompt), limit)
        stream = _typed(body, "stream", bool, False)
        options = _typed(body, "stream_options", dict, {}) or {}
        return Completion(kind, prompt, max_tokens, self._sampling(body), _stops(body.get("stop")), stream,
                          bool(options.get("include_usage", False)), _isolation(body))

    def _max_tokens(self, prompt_length: int, limit: object) -> int:
        """The request's `max_tokens` (at most the server's), or the server's cut to what the context leaves."""
        context_length = self.prompts.context_length
        room = None if context_length is None else context_length - prompt_length
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt is {prompt_length} tokens; this model's context is {context_length}",
                           param="messages", code="context_length_exceeded")
        if limit is None:
            return self.max_tokens if room is None else min(self.max_tokens, room)
        if not _is_int(limit) or limit < 1:
            raise ApiError(400, "max_tokens must be an integer of at least 1", param="max_tokens")
        if room is not None and limit > room:
            raise ApiError(400, f"the prompt ({prompt_length} tokens) and max_tokens ({limit}) exceed this model's "
                                f"context of {context_length}", param="max_tokens",
                           code="context_length_exceeded")
        if limit > self.max_tokens:  # refused, not cut: the client learns it would not get what it asked for
            raise ApiError(400, f"max_tokens is too large: {limit}; this server generates at most {self.max_tokens} "
                                f"tokens a request", param="max_tokens")
        return limit

    def _sampling(self, body: Mapping) -> SamplingParams:
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise ApiError(400, "top_p must be above 0", param="top_p")
        seed = body.get("seed")
        if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):
            raise ApiError(400, "seed must be an integer from 0 to 2**63 - 1", param="seed")
        return SamplingParams(temperature=temperature, top_p=None if top_p == 1.0 else top_p,
                              repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                              **({} if seed is None else {"seed": seed}))


def _messages(messages: object) -> list[dict[str, str]]:
    """`messages` as the template takes them: a role and a text each (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    read = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object with a role among {', '.join(ROLES)}", param=where)
        content = _content(message.get("content"), where)
        _utf8_length(content, f"{where}.content")
        read.append({"role": message["role"], "content": content})
    return read


def _content(content: object, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _utf8_length(text: str, param: str) -> int:
    """`text`'s length in UTF-8; 400 for a lone surrogate (JSON's "\\ud800" reads as one), which has none."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (a lone surrogate)", param=param) from None


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", param="stop")
    return tuple(stops)


def _isolation(body: Mapping) -> tuple[str, ...] | None:
    """The request's isolation key: its `user` and `cache_salt` (vLLM's), None when it names neither."""
    user, salt = _typed(body, "user", str, ""), _typed(body, "cache_salt", str, "")
    return ("key", user, salt) if user or salt else None


def _typed(body: Mapping, name: str, kind: type, default: object) -> object:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ApiError(400, f"{name} must be a {kind.__name__}", param=name)
    return value


def _number(body: Mapping, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}", param=name)
    return float(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
