"""Temperature / top-k / top-p: the distribution the verifier compares against is transformers'
own, and the batched sampler draws from exactly that nucleus."""

import pytest
import torch
from conftest import assert_same_numbers
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specheads.sampling import TOP_P_CANDIDATES, nucleus, sample, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampling_probs_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 0), (0.8, 1.0, 5), (0.6, 0.7, 10)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        assert_same_numbers(sampling_probs(logits, temperature, top_p, top_k), scores.softmax(-1))
        assert_same_numbers(sampling_probs(logits[0], temperature, top_p, top_k), scores[0].softmax(-1))


def test_the_nucleus_widens_past_the_first_candidates():
    flat = torch.full((2, 3 * TOP_P_CANDIDATES), 1.0 / (3 * TOP_P_CANDIDATES))
    kept, ids = nucleus(flat, 0.5)
    assert ids.shape[-1] > TOP_P_CANDIDATES
    assert_same_numbers(kept.sum(-1), torch.tensor([0.5, 0.5]))


def test_sample_keeps_only_the_nucleus():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    picked = sample(logits, 1.0, 0.8, g)
    assert set(picked.tolist()) == {0, 1}
    assert abs((picked == 0).float().mean().item() - 0.5 / 0.8) < 0.05
    # the same nucleus as the verifier's distribution
    assert torch.equal(sampling_probs(logits[0], 1.0, 0.8) > 0, torch.tensor([True, True, False, False]))
    # a flat distribution needs more candidates than the first top-k guess: it must widen
    picked = sample(torch.zeros(4000, 3000), 1.0, 0.5, g)
    assert 512 < len(set(picked.tolist())) <= 1501


def test_temperature_zero_is_greedy():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, 0.0, 0.9), logits.argmax(-1))
