"""The transformers baselines: the target's own output, with decode-phase forwards counted."""

import torch

from specheads.decode.baselines import hf_generate
from specheads.decode.generate import SamplingConfig


def test_hf_baseline_counts_decode_forwards(tiny_target):
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = hf_generate(tiny_target, prompt, SamplingConfig(max_new_tokens=7))
    assert len(out["output_ids"]) == 7 and out["target_forwards"] == 6
    ref = tiny_target.model.generate(prompt, max_new_tokens=7, do_sample=False)[0, 4:].tolist()
    assert out["output_ids"] == ref
    pld = hf_generate(tiny_target, prompt, SamplingConfig(max_new_tokens=7), prompt_lookup=(4, 2))
    assert pld["output_ids"] == ref


def test_the_answer_ends_at_the_first_eos(tiny_target):
    prompt = torch.tensor([[1, 2, 3, 4]])
    full = hf_generate(tiny_target, prompt, SamplingConfig(max_new_tokens=8))["output_ids"]
    eos = full[3]
    cut = hf_generate(tiny_target, prompt, SamplingConfig(max_new_tokens=8, eos_token_ids=[eos]))["output_ids"]
    assert cut == full[: full.index(eos) + 1]
