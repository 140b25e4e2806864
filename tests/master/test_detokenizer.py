"""Streamed text over a SentencePiece vocabulary: a word's leading space ("▁there") kept on the first
generated token, as the text of the prompt and completion together has it.

A SentencePiece decoder strips the space of a text's first token, so the first generated token decoded
alone loses it ("Once upon a time" + "▁there" would show "timethere"). The vocabulary here is one list
of SentencePiece pieces (the three specials, single characters, then "▁" words up to the synthetic
model's vocabulary; no byte tokens, since a random model's lone bytes are no UTF-8 text, which decodes
differently by where it is cut), built two ways: a tokenizer.json with the Metaspace pre-tokenizer and
decoder (as Mistral's), beside a synthetic checkpoint directory; and the tokenizer.ggml.* metadata of a
GGUF file (tokenizer.ggml.model llama, cakemp's spm.py). Every layer is local; the streamed pieces and
the Generation's text are each compared with decode(prompt + completion) less decode(prompt).

Then the Detokenizer alone over a byte-level vocabulary (a token per byte, and a special token): a
character cut across byte tokens is shown whole once its last byte comes, and a long run of tokens
that make no character, or no text, is decoded a bounded window at a time (the ids asked of the
tokenizer are counted), its text what the whole run decodes to.
"""

from __future__ import annotations

import asyncio
import json
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from cakemp.master.detokenizer import MOST_PENDING, Detokenizer
from cakemp.master.generator import Generator
from cakemp.master.sampler import SamplingParams
from cakemp.topology import Topology
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

SPACE = "\u2581"
SPECIALS = ["<s>", "</s>", "<unk>"]  # ids 0, 1 and 2: the synthetic checkpoint's BOS and EOS first
PIECES = [SPACE, *string.ascii_letters, ",", ".", *(SPACE + w for w in ("Once", "upon", "a", "time", "there", "was"))]
PROMPTS = ["Once upon a time", "The cat sat", "In a land far away,", "Hello", "One two three four five six"]
STEPS = 8
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
SPEC = SyntheticSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)


def vocabulary(size: int) -> list[str]:
    """`size` SentencePiece pieces: specials, characters, then "▁w<i>" words to fill it."""
    tokens = SPECIALS + PIECES
    return tokens + [f"{SPACE}w{i}" for i in range(size - len(tokens))]


def metaspace_tokenizer(tokens: list[str]) -> Tokenizer:
    """A tokenizer.json as Mistral's: Metaspace pre-tokenizer and decoder (then byte fallback's), <s> first."""
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], byte_fallback=True,
                                     fuse_unk=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(replacement=SPACE, prepend_scheme="first"),
                                           decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    """A synthetic checkpoint whose tokenizer.json is the Metaspace one, of the model's vocabulary size."""
    model = tmp_path_factory.mktemp("metaspace")
    write_checkpoint(model, SPEC)
    config = json.loads((model / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    metaspace_tokenizer(vocabulary(config["vocab_size"])).save(str(model / "tokenizer.json"))
    return model


def gguf_file(directory):
    tokens = vocabulary(512)
    types = [3, 3, 2] + [1] * (len(tokens) - 3)  # control, control, unknown, then normal
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))], "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
                "tokenizer.ggml.unknown_token_id": 2}
    return write_gguf(directory / "spm.gguf", GgufSpec("llama", layers=2, vocab=len(tokens), global_metadata=metadata))


def generations(model):
    """Per prompt: its ids, the completion's ids (no end token), the streamed pieces joined, the text."""
    async def go():
        async with await Generator.open(model, Topology(()), dtype="f32") as generator:
            out = []
            for prompt in PROMPTS:
                pieces = []
                generation = await generator.generate(prompt, STEPS, GREEDY, on_text=pieces.append)
                completion = [t for t in generation.tokens if t not in generator.eos_ids]
                out.append((generation.prompt_tokens, completion, "".join(pieces), generation.text))
            return generator.tokenizer, out

    return asyncio.run(asyncio.wait_for(go(), 120))


def assert_texts_in_context(tokenizer, generated):
    """Each text is what the completion adds to the prompt's decoded text; some start with a word's space."""
    expected_texts = []
    for prompt, completion, streamed, text in generated:
        prompt_text, whole = tokenizer.decode(list(prompt)), tokenizer.decode(list(prompt) + completion)
        assert whole.startswith(prompt_text)
        expected = whole[len(prompt_text):]
        assert (streamed, text) == (expected, expected)
        expected_texts.append(expected)
    assert any(t.startswith(" ") for t in expected_texts), expected_texts  # the first token was a "▁" word


def test_a_metaspace_tokenizer_json_keeps_the_first_generated_word_s_space(directory):
    assert_texts_in_context(*generations(directory))


@needs_gguf
def test_a_gguf_sentencepiece_vocabulary_keeps_the_first_generated_word_s_space(tmp_path):
    assert_texts_in_context(*generations(gguf_file(tmp_path)))


def byte_tokenizer() -> Tokenizer:
    """A token per byte (the byte-level alphabet, no merges), and <|end|> after them, decoded as no text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end|>"])
    return tokenizer


class CountedDecodes:
    """A tokenizer that remembers the longest list of ids it was asked to decode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids: list[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids)


def streamed(tokenizer, prompt: list[int], completion: list[int]) -> list[str]:
    """The pieces a Detokenizer hands out for `completion`, its flush last."""
    detokenizer = Detokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token) for token in completion]
    return [*pieces, detokenizer.flush()]


def test_characters_cut_across_byte_tokens_are_shown_whole():
    tokenizer = byte_tokenizer()
    text = "naïve 日本語, 😀 and 𝄞 ok"
    completion = tokenizer.encode(text).ids
    assert len(completion) > len(text)  # some characters are several tokens
    pieces = streamed(tokenizer, tokenizer.encode("Once").ids, completion)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("filler", ["a lone continuation byte", "a special token"])
def test_a_run_of_tokens_that_make_no_character_costs_a_bounded_window_each(filler):
    tokenizer = byte_tokenizer()
    token = tokenizer.encode("é").ids[1] if filler == "a lone continuation byte" else tokenizer.token_to_id("<|end|>")
    completion = [token] * 2000 + tokenizer.encode("ok").ids
    counted = CountedDecodes(tokenizer)
    pieces = streamed(counted, tokenizer.encode("Once").ids, completion)
    assert counted.longest <= 2 * MOST_PENDING  # the tokens shown last, and those pending
    assert "".join(pieces) == tokenizer.decode(completion)  # 2000 U+FFFD then "ok", or "ok"
