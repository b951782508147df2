"""The transformers baselines: the target's own output, with decode-phase forwards counted."""

import pytest
import torch

from specheads.decode.baselines import hf_generate
from specheads.decode.generate import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_hf_baselines_run_transformers_as_shipped(monkeypatch):
    """Kernels this package installs on the target are suspended inside hf_generate, and restored."""
    from specheads.kernels import gqa_attention, linear_layout
    from specheads.target import FrozenTarget
    from specheads.tiny import tiny_target

    model, tok = tiny_target("llama")
    model.set_attn_implementation("sdpa")
    target = FrozenTarget(model, tok, name="tiny-random")
    linear_layout.install(model, linear_layout.RowLayouts.everywhere(linear_layout.WEIGHT_LEFT))
    gqa_attention.install(model)
    routed, seen = [], []
    real = linear_layout.weight_left_linear
    monkeypatch.setattr(linear_layout, "weight_left_linear", lambda *a: routed.append(1) or real(*a))
    model.register_forward_pre_hook(lambda *_: seen.append(model.config._attn_implementation))
    hf_generate(target, torch.tensor([[1, 2, 3, 4]]), SamplingConfig(max_new_tokens=4), prompt_lookup=(3, 2))
    assert not routed and set(seen) == {"sdpa"}
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert routed and model.config._attn_implementation == gqa_attention.NAME  # restored after the call
