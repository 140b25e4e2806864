"""RequestReader (cakemp/master/openai_request.py), in-process over a real byte-level tokenizer:
the range of each sampling field at its boundaries, as OpenAI accepts and refuses them."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cakemp.master.openai_request import ApiError, RequestReader
from cakemp.master.prompt_encoding import PromptEncoder

MODEL = "tiny"


def text(body: dict):
    """What RequestReader.text makes of `body`, with prompts encoded as `cakemp serve` encodes them."""
    async def read():
        prompts = PromptEncoder(tokenizer(), context_length=64)
        try:
            return await RequestReader(MODEL, prompts, None, max_tokens=8).text(body)
        finally:
            prompts.close()
    return asyncio.run(read())


def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.mark.parametrize("temperature", [0, 0.0, 1, 1.999, 2, 2.0])
def test_a_temperature_from_0_to_2_is_taken_as_it_is(temperature):
    completion = text({"model": MODEL, "prompt": "hi", "temperature": temperature})
    assert completion.sampling.temperature == temperature


@pytest.mark.parametrize("temperature", [-0.001, 2.001, 3, True, "1"])
def test_a_temperature_outside_0_to_2_is_refused_naming_it(temperature):
    with pytest.raises(ApiError) as refused:
        text({"model": MODEL, "prompt": "hi", "temperature": temperature})
    assert refused.value.status == 400
    assert refused.value.body()["error"]["param"] == "temperature"
    assert "temperature must be a number from 0 to 2" in refused.value.body()["error"]["message"]
