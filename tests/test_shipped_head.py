"""The head shipped in the repository (heads/smollm2-135m-eagle3): it loads on the embedded target,
is small bf16 safetensors with its calibrated tree and provenance, and decodes losslessly."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specheads.bench.inputs import encode_prompt
from specheads.config.infer import TreeConfig
from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import make_drafter
from specheads.decode.generate import SamplingConfig, speculative_generate
from specheads.decode.policy import tree_policy_for
from specheads.export import open_head

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-eagle3"


def test_shipped_head_is_small_bf16_with_tree_and_provenance():
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 30 * 2**20
    with safe_open(str(weights), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16", "I64", "BOOL"}  # weights; d2t, t2d maps
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["family"] == "eagle3" and config["target"]["name"] == "smollm2-135m"
    assert config["default_tree"], "the calibrated tree is stored with the head"
    training = config["training"]
    assert training["steps"] > 0 and training["commit"] and "train.py" in training["command"]
    assert "smollm2_selfdistill" in training["data"] and training["data_mix"]
    assert "data.decontaminate" in training["command"]  # trained on decontaminated data only


def test_shipped_head_decodes_losslessly_on_the_embedded_target(smollm2_target):
    head = open_head(SHIPPED, smollm2_target)
    assert head.target_layer_ids() == [2, 15, 27]
    tok = smollm2_target.tokenizer
    prompt = torch.tensor([encode_prompt(tok, "Give me three tips for staying focused while studying.", None, True)])
    cfg = SamplingConfig(max_new_tokens=24, temperature=0.0, eos_token_ids=(tok.eos_token_id,))
    plain = speculative_generate(smollm2_target, PlainDrafter(), prompt, cfg)
    drafter = make_drafter(head, tree_policy_for(head, TreeConfig(kind="default")))
    spec = speculative_generate(smollm2_target, drafter, prompt, cfg)
    assert spec.output_ids == plain.output_ids
    assert sum(spec.accepted_drafts) > 0  # the head's drafts were accepted, not just the target's tokens
