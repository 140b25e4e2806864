"""Incremental detokenization: the text a generation gained with each token, at a cost that does not
grow with the generation.

Decoding the whole token list after every token costs O(n) a step, O(n^2) a generation (25 ms a step
at 32K tokens on a real tokenizer). As transformers' TextStreamer and vLLM's detokenizer do, only a
short window is decoded: the tokens since `prefix_offset` (already shown, kept so that a tokenizer
that strips or merges at a window's start decodes them as it would in context) and those after
`read_offset` (not yet shown). What the window decodes to past the shown tokens' text is the new
text. Byte-level tokens can end inside a UTF-8 character, which decodes to U+FFFD: such a tail waits
for the token that completes it, and `flush` hands out whatever is left once the generation ends.
It waits for `MOST_PENDING` tokens at most, as it does for tokens that add no text: a run of bytes
that never make a character (a model's garbage, or a client's prompt that asks for it) would
otherwise grow the window with every token, and cost O(n^2) again. Past that the window shows what
it decodes to, U+FFFD included, and moves on.

The window starts in the prompt's last `PROMPT_CONTEXT` tokens, shown already, as vLLM's does: a
tokenizer that strips a word's leading space at the start of a text (SentencePiece's Metaspace,
llama.cpp's add_space_prefix) would otherwise drop the first generated word's ("time" + "▁there"
shown as "timethere"). Decoded after the prompt's tail, the first token's text is what it adds to the
prompt's: the generated text is decode(prompt + completion) less decode(prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# Prompt tokens the first window starts with: enough that the last word's text is decoded whole.
PROMPT_CONTEXT = 5
# Tokens not yet shown that the window waits for at most. A UTF-8 character is 4 bytes at most, so a
# character cut across byte tokens is complete within 4, even behind a few bytes that make none.
MOST_PENDING = 8


class Detokenizer:
    """Feeds on one generation's tokens, one at a time; hands back the text each adds."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt[-PROMPT_CONTEXT:])  # the prompt's tail, then what is generated
        self._prefix_offset = 0  # the window's start: tokens before it are never decoded again
        self._read_offset = len(self.tokens)  # tokens before it are shown (the prompt's, by its client)
        self.text = ""  # everything handed out so far: the prompt's tail excluded

    def add(self, token: int) -> str:
        """The text `token` completes ("" while a character waits for its last byte, up to MOST_PENDING tokens)."""
        self.tokens.append(token)
        shown = self.tokenizer.decode(self.tokens[self._prefix_offset:self._read_offset])
        window = self.tokenizer.decode(self.tokens[self._prefix_offset:])
        waits = len(window) <= len(shown) or window.endswith("\ufffd")
        if waits and len(self.tokens) - self._read_offset < MOST_PENDING:
            return ""
        piece = window[len(shown):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        self.text += piece
        return piece

    def flush(self) -> str:
        """What the tokens not yet shown decode to, once no token follows (a cut character included)."""
        shown = self.tokenizer.decode(self.tokens[self._prefix_offset:self._read_offset])
        window = self.tokenizer.decode(self.tokens[self._prefix_offset:])
        piece = window[len(shown):] if window.startswith(shown) else ""
        self._prefix_offset = self._read_offset = len(self.tokens)
        self.text += piece
        return piece
