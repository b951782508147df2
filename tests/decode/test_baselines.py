"""The transformers baselines: the target's own output, with decode-phase forwards counted."""

import pytest
import torch

from specheads.config.train import ModelConfig
from specheads.decode.baselines import hf_generate
from specheads.decode.generate import SamplingConfig
from specheads.target import load_target


@pytest.fixture(scope="module")
def target():
    return load_target(ModelConfig(name="tiny-random", path="tiny:llama"), torch.device("cpu"))


def test_hf_baseline_counts_decode_forwards(target):
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = hf_generate(target, prompt, SamplingConfig(max_new_tokens=7))
    assert len(out["output_ids"]) == 7 and out["target_forwards"] == 6
    ref = target.model.generate(prompt, max_new_tokens=7, do_sample=False)[0, 4:].tolist()
    assert out["output_ids"] == ref
    pld = hf_generate(target, prompt, SamplingConfig(max_new_tokens=7), prompt_lookup=(4, 2))
    assert pld["output_ids"] == ref


def test_the_answer_ends_at_the_first_eos(target):
    prompt = torch.tensor([[1, 2, 3, 4]])
    full = hf_generate(target, prompt, SamplingConfig(max_new_tokens=8))["output_ids"]
    eos = full[3]
    cut = hf_generate(target, prompt, SamplingConfig(max_new_tokens=8, eos_token_ids=[eos]))["output_ids"]
    assert cut == full[: full.index(eos) + 1]
