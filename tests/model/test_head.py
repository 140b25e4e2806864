import pytest
import torch
from safetensors import safe_open

from cakemp.checkpoint.config import ModelConfig
from cakemp.model.head import Head
from tests.support.checkpoints import make_checkpoint
from tests.support.tolerance import PARITY, Accuracy, float64_throughout

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("tied", [False, True])
def test_head_matches_transformers(tmp_path, family, tied):
    """Embeddings equal HF's embed_tokens; the last position's logits are as close to HF's
    lm_head(norm(x)) in f64 as HF's own in f32 are (within 3x, tests/support/tolerance.py), tied or not
    (Gemma 3: embeddings scaled by sqrt(H), a (1 + w) final norm)."""
    path = make_checkpoint(tmp_path, family, tie_word_embeddings=tied)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    head = Head.load(path, ModelConfig.from_dir(path), "cpu", torch.float32)
    tokens = [3, 17, 99, 0, 127]
    x = torch.randn(1, 4, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_embed = hf.model.embed_tokens(torch.tensor([tokens]))
        expected_logits = hf.lm_head(hf.model.norm(x))[0, -1]
        with float64_throughout():
            exact_logits = hf64.lm_head(hf64.model.norm(x.double()))[0, -1]
    assert torch.equal(head.embed(tokens), expected_embed)
    accuracy = Accuracy.of([(head.logits(x), expected_logits, exact_logits)], torch.float32)
    accuracy.assert_within(PARITY[torch.float32])
    assert (head.lm_head_weight is head.embed_weight) is tied


def test_head_casts_to_the_compute_dtype(tmp_path):
    """Weights stored in f32 are loaded in the asked dtype, and so are embeddings and logits."""
    path = make_checkpoint(tmp_path, "llama")
    head = Head.load(path, ModelConfig.from_dir(path), "cpu", torch.bfloat16)
    x = head.embed([1, 2])
    assert x.dtype == head.logits(x).dtype == torch.bfloat16
    assert x.shape == (1, 2, 64) and head.logits(x).shape == (128,)


def test_qwen3_5_head_sits_beside_the_language_model_with_a_plus_one_norm(tmp_path):
    """Qwen3.5's embeddings and final norm are under model.language_model, the norm weight 1 + w."""
    path = make_checkpoint(tmp_path, "qwen3_5")
    head = Head.load(path, ModelConfig.from_dir(path), "cpu", torch.float32)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert torch.equal(head.embed_weight, f.get_tensor("model.language_model.embed_tokens.weight"))
        assert torch.equal(head.norm_weight, f.get_tensor("model.language_model.norm.weight") + 1)
        assert torch.equal(head.lm_head_weight, f.get_tensor("lm_head.weight"))
