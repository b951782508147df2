"""Format speculators for a DFlash head (speculators' `dflash` type): the round trip drafts the same
tokens, the causality flag is written explicitly, and variants we do not train are refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import edit_config, make_head_dir
from test_export_dflash import drafts

from specheads.errors import SpecHeadsError
from specheads.export import check_directory, export_head, load_exported, open_head
from specheads.export.speculators_dflash import speculative_tokens, vllm_view
from specheads.heads import load_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("overrides", [{}, {"dflash_layers": 3, "block_size": 4, "mask_token_id": 7}])
def test_round_trip_drafts_the_same_tokens(tiny_target, tmp_path, overrides):
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash", **overrides)
    result = export_head(src, "speculators", tmp_path / "out")
    assert result.engines == ["vllm", "speculators"] and result.findings == {"vllm": [], "speculators": []}
    original = load_head(src, tiny_target)
    spec = original.spec
    config = json.loads((result.path / "config.json").read_text())
    assert "model_type" not in config  # vLLM reads a config without one, with speculators_config, as speculators'
    assert config["architectures"] == ["DFlashSpeculator"] and config["speculators_model_type"] == "dflash"
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == spec.block_size - 1
    assert config["aux_hidden_state_layer_ids"] == spec.layer_ids  # vLLM's numbering = ours
    assert config["mask_token_id"] == spec.mask_token_id and config["block_size"] == spec.block_size
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["is_causal"] is False
    assert not {"architectures", "block_size", "dflash_config", "num_target_layers"} & set(layer)
    # what vLLM builds from it (algos.update_dflash): the native DFlash fields, non-causal
    assert vllm_view(config)["dflash_config"] == {
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": [k - 1 for k in spec.layer_ids],
        "sample_from_anchor": False,
        "causal": False,
    }
    exported = open_head(result.path, tiny_target)
    assert type(exported) is type(original) and exported.spec.block_size == spec.block_size
    with torch.no_grad():
        before, after = drafts(original, tiny_target), drafts(exported, tiny_target)
    assert torch.equal(before, after)
    edit_config(result.path, lambda c: c.pop("specheads"))  # the engine fields alone give the same head
    with torch.no_grad():
        assert torch.equal(drafts(load_exported(result.path, tiny_target), tiny_target), before)


def test_draft_length_is_the_trained_block_or_shorter():
    assert speculative_tokens(8, None) == 7 and speculative_tokens(8, 3) == 3
    with pytest.raises(SpecHeadsError, match="block_size 8 drafts 1..7 tokens"):
        speculative_tokens(8, 8)


def causal_variant(config):
    """sliding_window_non_causal false (the library's default): vLLM then runs every layer causally."""
    config.update(sliding_window_non_causal=False)
    config["transformer_layer_config"].pop("is_causal")


@pytest.mark.parametrize(
    "change, message",
    [
        (causal_variant, "causal"),
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda c: c.pop("mask_token_id"), "mask_token_id"),
    ],
)
def test_wrong_variants_are_refused(tiny_target, tmp_path, change, message):
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash")
    out = export_head(src, "speculators", tmp_path / "out").path
    edit_config(out, change)
    found = check_directory(out, "speculators")
    assert found["vllm"] and found["speculators"] and any(message in p for p in found["vllm"])
    with pytest.raises(SpecHeadsError, match=message):
        load_exported(out, tiny_target)


def test_another_speculators_type_is_refused(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash")
    out = export_head(src, "speculators", tmp_path / "out").path
    edit_config(out, lambda c: c.update(speculators_model_type="mtp"))  # provenance still says speculators
    with pytest.raises(SpecHeadsError, match="speculators_model_type 'mtp' is not one specheads reads"):
        load_exported(out, tiny_target)
    with pytest.raises(SpecHeadsError, match="drafts 1..7 tokens"):
        export_head(src, "speculators", tmp_path / "long", num_speculative_tokens=8)
    with pytest.raises(SpecHeadsError, match="without embeddings"):
        export_head(src, "speculators", tmp_path / "emb", embeddings=True)


def test_model_card_serves_it_as_dflash(tiny_target, tmp_path):
    from specheads.export import HeadSource
    from specheads.export.model_card import serve_commands

    src = HeadSource.read(make_head_dir(tiny_target, tmp_path / "head", "dflash", block_size=4))
    commands = dict(serve_commands(src, "speculators", ["vllm", "speculators"], "DRAFT", "TARGET"))
    assert '"method": "dflash"' in commands["vLLM"] and '"num_speculative_tokens": 3' in commands["vLLM"]
    assert "DFlashDraftModel.from_pretrained('DRAFT')" in commands["speculators (Python)"]
