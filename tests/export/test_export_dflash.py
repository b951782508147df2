"""Format dflash (vLLM's DFlashDraftModel): the round trip drafts the same tokens, the engine fields
alone are enough, the tied k_norm is written per layer and untied copies are refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import PROMPT, edit_config, edit_tensors, make_head_dir

from specheads.errors import SpecHeadsError
from specheads.export import check_directory, export_head, load_exported, open_head
from specheads.heads import load_head

pytestmark = pytest.mark.usefixtures("one_thread")


def drafts(head, target):
    """The block's logits after the prompt (every draft position, one forward)."""
    s = target.states(PROMPT, layer_ids=head.target_layer_ids(), final=False)
    features = head.input_features(s.hidden)
    return head.parallel_logits(PROMPT, features, head.new_cache(), head.spec.block_size - 1)


@pytest.mark.parametrize("overrides", [{}, {"dflash_layers": 3, "block_size": 4, "mask_token_id": 7}])
def test_round_trip_drafts_the_same_tokens(tiny_target, tmp_path, overrides):
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash", **overrides)
    result = export_head(src, "dflash", tmp_path / "out")
    assert result.engines == ["vllm"] and result.findings == {"vllm": []}
    config = json.loads((result.path / "config.json").read_text())
    original = load_head(src, tiny_target)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": original.spec.mask_token_id,
        "target_layer_ids": [k - 1 for k in original.spec.layer_ids],  # layer outputs: ours - 1
        "causal": False,
        "use_aux_hidden_state": True,
    }
    assert config["is_causal"] is False and config["num_hidden_layers"] == original.spec.dflash_layers
    exported = open_head(result.path, tiny_target)
    assert type(exported) is type(original) and exported.spec.block_size == original.spec.block_size
    with torch.no_grad():
        before, after = drafts(original, tiny_target), drafts(exported, tiny_target)
    assert torch.equal(before, after)
    # without our provenance block: the engine fields alone give the same head
    edit_config(result.path, lambda c: c.pop("specheads"))
    with torch.no_grad():
        assert torch.equal(drafts(load_exported(result.path, tiny_target), tiny_target), before)


def test_k_norm_is_written_per_layer_and_untied_copies_are_refused(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash", dflash_layers=3)
    out = export_head(src, "dflash", tmp_path / "out").path
    from safetensors.torch import load_file

    written = load_file(str(out / "model.safetensors"))
    norms = [written[f"layers.{i}.self_attn.k_norm.weight"] for i in range(3)]
    assert "k_norm.weight" not in written and all(torch.equal(n, norms[0]) for n in norms)
    assert not any(k.startswith(("embed_tokens", "lm_head", "mask_hidden", "d2t")) for k in written)

    def untie(tensors):
        tensors["layers.2.self_attn.k_norm.weight"] = tensors["layers.2.self_attn.k_norm.weight"] + 0.1

    edit_tensors(out, "model.safetensors", untie)
    assert any("k_norm weights differ" in p for p in check_directory(out, "dflash")["vllm"])
    with pytest.raises(SpecHeadsError, match="k_norm weights differ"):
        load_exported(out, tiny_target)


def test_what_the_dflash_format_refuses(tiny_target, tmp_path):
    unsorted = make_head_dir(tiny_target, tmp_path / "a", "dflash", layer_ids=[4, 2])
    with pytest.raises(SpecHeadsError, match="ascending, distinct head.layer_ids"):
        export_head(unsorted, "dflash", tmp_path / "out")
    embedding = make_head_dir(tiny_target, tmp_path / "b", "dflash", layer_ids=[0, 3])
    with pytest.raises(SpecHeadsError, match=r"layer ids \[0\] have no DFlash target_layer_id"):
        export_head(embedding, "dflash", tmp_path / "out")
    ok = make_head_dir(tiny_target, tmp_path / "c", "dflash")
    with pytest.raises(SpecHeadsError, match="format eagle3 holds eagle3/peagle heads"):
        export_head(ok, "eagle3", tmp_path / "out")
    out = export_head(ok, "dflash", tmp_path / "out").path
    edit_config(out, lambda c: c["dflash_config"].update(causal=True) or c.pop("is_causal"))
    assert any("causal must be written false" in p for p in check_directory(out, "dflash")["vllm"])
    with pytest.raises(SpecHeadsError, match="a causal DFlash draft"):
        load_exported(out, tiny_target)
