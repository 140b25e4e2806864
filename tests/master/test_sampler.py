from collections import Counter

import pytest
import torch

from cakemp.errors import ConfigError
from cakemp.master.sampler import Sampler, SamplingParams, penalize_repeats

FLAT = torch.zeros(64)
LOGITS = torch.tensor([1.0, 3.0, -2.0, 2.5, 0.5])


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits, []) for _ in range(n)]


def test_greedy_takes_the_argmax_whatever_the_seed():
    """A temperature of zero picks the largest logit, for any seed."""
    for seed in range(5):
        params = SamplingParams(temperature=0.0, seed=seed, repeat_penalty=1.0)
        assert draws(params, LOGITS, 3) == [1, 1, 1]


def test_same_seed_same_tokens_other_seed_other_tokens():
    """Sampling is reproducible from the seed, and the seed matters."""
    first = draws(SamplingParams(seed=7), FLAT, 30)
    assert draws(SamplingParams(seed=7), FLAT, 30) == first
    assert draws(SamplingParams(seed=8), FLAT, 30) != first


def test_temperature_sampling_follows_the_softmax():
    """At temperature 1 each token is drawn about as often as its softmax probability."""
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    counts = Counter(draws(SamplingParams(temperature=1.0), logits, 3000))
    assert counts[0] / 3000 == pytest.approx(0.7, abs=0.04)
    assert counts[1] / 3000 == pytest.approx(0.2, abs=0.04)
    assert counts[2] / 3000 == pytest.approx(0.1, abs=0.04)


def test_high_temperature_flattens_low_temperature_sharpens():
    """A higher temperature draws the less likely token more often."""
    logits = torch.tensor([1.0, 0.0])
    hot = Counter(draws(SamplingParams(temperature=5.0), logits, 2000))[1]
    cold = Counter(draws(SamplingParams(temperature=0.2), logits, 2000))[1]
    assert hot > 800 and cold < 50


def test_top_k_keeps_only_the_k_most_likely():
    """With top-k 3 every drawn token is one of the three largest logits, and each of them occurs."""
    tokens = set(draws(SamplingParams(temperature=100.0, top_k=3), LOGITS, 300))
    assert tokens == {1, 3, 0}


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Top-p keeps the most likely tokens until their mass reaches p, and at least one."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(draws(SamplingParams(top_p=0.7), logits, 300)) == {0, 1}
    assert set(draws(SamplingParams(top_p=0.81), logits, 300)) == {0, 1, 2}
    assert set(draws(SamplingParams(top_p=0.3), logits, 50)) == {0}


def test_top_k_then_top_p():
    """Top-p applies to the renormalised top-k set."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # Top-2 renormalised is [0.571, 0.429]: p=0.5 keeps the first only, p=0.6 both.
    assert set(draws(SamplingParams(top_k=2, top_p=0.5), logits, 100)) == {0}
    assert set(draws(SamplingParams(top_k=2, top_p=0.6), logits, 300)) == {0, 1}


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    """A repeated token's positive logit is divided by the penalty and a negative one multiplied."""
    out = penalize_repeats(LOGITS, [1, 2, 2], 2.0)
    assert out.tolist() == [1.0, 1.5, -4.0, 2.5, 0.5]
    assert LOGITS.tolist() == [1.0, 3.0, -2.0, 2.5, 0.5]


def test_repeat_penalty_changes_the_greedy_choice_within_the_window_only():
    """Greedy avoids a recently generated token, but not one older than repeat-last-n."""
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=2)
    sampler = Sampler(params)
    assert sampler.sample(LOGITS, [1]) == 3
    assert sampler.sample(LOGITS, [1, 4, 4]) == 1


def test_repeat_penalty_of_one_changes_nothing():
    """A penalty of 1.0 leaves the argmax on a repeated token."""
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.0))
    assert sampler.sample(LOGITS, [1, 1, 1]) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"repeat_penalty": 0.0}, {"repeat_last_n": -1}],
)
def test_invalid_params_are_refused(kwargs):
    """Sampling options that make no sense raise ConfigError."""
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_accepts_half_precision_logits_of_any_shape():
    """Logits [1, V] in f16 are sampled like the same f32 vector."""
    logits = LOGITS.to(torch.float16).unsqueeze(0)
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits, []) == 1
