"""A checkpoint's chat template, rendered as transformers renders it, and the tokens that end a reply.

The template is `chat_template.jinja` beside the tokenizer, else `tokenizer_config.json`'s
`chat_template` (one string, or named templates of which "default" is taken). Templates come
from model repositories, so they are untrusted code: like transformers' `apply_chat_template`
they run in jinja2's immutable sandbox, with `trim_blocks` and `lstrip_blocks`, the loop
controls extension, a `tojson` that does not escape HTML, `raise_exception` and `strftime_now`,
and they see `messages`, `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as strings. The rendered text is encoded without the
tokenizer's own special tokens (the template writes them), as transformers does.

A reply ends at any id that config.json or generation_config.json lists as `eos_token_id`, or at
the tokenizer's `eos_token` (an instruct model's end-of-turn marker is often only there).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from cakemp.errors import CheckpointError, ConfigError

# The special-token attributes transformers hands a template (its tokenizer's `special_tokens_map`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, str]


class TemplateRefused(ConfigError):
    """The template would not render these messages (its `raise_exception`, or a jinja error)."""


class ChatTemplate:
    """One checkpoint's chat template and the tokenizer that encodes what it renders."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], tokenizer: Tokenizer) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.tokenizer = tokenizer
        self._template = compile_template(source)

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none (a base model)."""
        model_dir = Path(model_dir)
        config = tokenizer_config(model_dir)
        jinja_file = model_dir / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else _configured_template(config)
        if source is None:
            return None
        return cls(source, special_tokens(model_dir, config), tokenizer)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ({"role", "content"} each), ending with the assistant's turn opened."""
        return render_template(self._template, self.special_tokens, messages, add_generation_prompt)

    def encode(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's token ids for `messages`: the rendering, encoded with no special tokens added."""
        return self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox; CheckpointError when it is not a template."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise CheckpointError(f"the chat template does not compile: {exc}") from None


def render_template(template: jinja2.Template, special_tokens: Mapping[str, str], messages: Sequence[Message],
                    add_generation_prompt: bool = True) -> str:
    """`template`'s text for `messages`, as transformers renders it; TemplateRefused for what it raises."""
    try:
        return template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.TemplateError as exc:
        raise TemplateRefused(f"the chat template refused these messages: {exc}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:  # its own code failed
        raise TemplateRefused(f"the chat template failed on these messages: {exc!r}"[:500]) from None


def conversation(system_prompt: str, prompt: str) -> list[dict[str, str]]:
    """A one-turn chat as Cake's master builds it: the system prompt (unless empty), then the user's prompt."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": prompt}]


def tokenizer_config(model_dir: Path) -> dict:
    """tokenizer_config.json, or {} when the checkpoint has none."""
    return _json(model_dir / "tokenizer_config.json")


def special_tokens(model_dir: Path, config: Mapping) -> dict[str, str]:
    """The special tokens as strings: tokenizer_config.json's, over special_tokens_map.json's (transformers' order)."""
    found = {**_json(model_dir / "special_tokens_map.json"), **config}
    tokens = {name: _token_text(found[name]) for name in SPECIAL_TOKENS if found.get(name) is not None}
    return {name: text for name, text in tokens.items() if text is not None}


def end_token_ids(model_dir: str | Path, tokenizer: Tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the `eos_token_id`s of config.json and generation_config.json
    (one id or a list each) and the tokenizer's `eos_token`."""
    model_dir = Path(model_dir)
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        eos = _json(model_dir / name).get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    eos_token = special_tokens(model_dir, tokenizer_config(model_dir)).get("eos_token")
    if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
        ids.add(eos_id)
    return frozenset(ids)


def _configured_template(config: Mapping) -> str | None:
    """tokenizer_config.json's template: a string, or a list of {"name", "template"} of which "default" is used."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError("tokenizer_config.json's chat_template is neither a template nor a list naming a default")


def _token_text(token: object) -> str | None:
    """A special token as written in the configs: a string, or an added-token object with its `content`."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which a prompt must not see.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with it (for
    training masks); a prompt is its body as written."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
