"""specheads/heads/io.py: a head directory records its target's identity and its own family's fields;
loading refuses another target of the same shape unless asked, and old heads still load."""

import json
import types

import pytest
import torch
from conftest import quick_head, thinking_target

from specheads.config.model import ModelConfig
from specheads.config.train import HeadConfig, family_fields
from specheads.errors import SpecHeadsError
from specheads.heads import load_head, save_head
from specheads.target import load_target, loaded_as, target_identity

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, dtype="float32"):
    return load_target(
        ModelConfig(name="tiny-random", path="tiny:llama", tiny={"seed": seed}, dtype=dtype), torch.device("cpu")
    )


def test_a_head_records_its_targets_identity_and_loads_back_silently(tmp_path, tiny_target, capsys):
    head = quick_head(tiny_target, "eagle3")
    directory = save_head(head, tmp_path / "head")
    recorded = json.loads((directory / "config.json").read_text())["target"]["identity"]
    assert recorded == target_identity(tiny_target)
    assert recorded["source"] == "tiny:llama" and len(recorded["weights_sha256"]) == 64
    capsys.readouterr()
    assert load_head(directory, tiny_target).target_identity == recorded
    # the same weights loaded in bf16 are the same target
    load_head(directory, tiny(dtype="bfloat16"))
    assert capsys.readouterr().err == ""


def test_other_weights_of_the_same_shape_are_refused_unless_asked(tmp_path, tiny_target, capsys):
    directory = save_head(quick_head(tiny_target, "medusa"), tmp_path / "head")
    other = tiny(seed=1)
    assert other.info == tiny_target.info  # check_compatible alone would let it through
    with pytest.raises(SpecHeadsError) as err:
        load_head(directory, other)
    line = str(err.value)
    assert "\n" not in line and "allow_target_mismatch=true" in line
    ours, theirs = target_identity(tiny_target)["weights_sha256"], target_identity(other)["weights_sha256"]
    assert ours[:12] in line and theirs[:12] in line  # names both
    capsys.readouterr()
    head = load_head(directory, other, allow_target_mismatch=True)
    assert head.target_identity["weights_sha256"] == ours  # still the identity it was trained on
    assert "same shape, other weights" in capsys.readouterr().err


def test_an_old_head_with_every_familys_fields_and_no_identity_loads_with_one_warning(tmp_path, tiny_target, capsys):
    head = quick_head(tiny_target, "eagle3")
    directory = save_head(head, tmp_path / "head")
    config = json.loads((directory / "config.json").read_text())
    assert set(config["head"]) == set(family_fields("eagle3"))  # its own family's fields only
    # as written before: every family's fields, no identity
    config["head"] = {**vars(HeadConfig(lora_r=64, medusa_decay=0.5)), **config["head"]}
    del config["target"]["identity"]
    (directory / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    for _ in range(2):
        loaded = load_head(directory, tiny_target)
    assert capsys.readouterr().err.count("records no target identity") == 1
    assert loaded.spec == head.spec and loaded.target_identity is None
    for a, b in zip(loaded.state_dict().values(), head.state_dict().values()):
        assert torch.equal(a, b)
    resaved = json.loads((save_head(loaded, tmp_path / "again") / "config.json").read_text())
    assert "lora_r" not in resaved["head"] and "medusa_decay" not in resaved["head"]


def test_a_head_loaded_onto_a_target_that_renders_otherwise_says_so_once(tmp_path, tiny_target, capsys):
    """infer.py's check (its heads load through load_head): a head records the chat template and
    model.thinking it trained on (config.json training.chat); another thinking setting or template
    is said in one line, once; the same rendering, a head without the record and the head shipped
    in heads/ (made before it) say nothing."""
    from pathlib import Path

    from specheads.chat_template import chat_record
    from specheads.heads.io import head_chat_mismatch, read_head_config

    off = thinking_target(False)
    training = {"chat": chat_record(off.tokenizer)}
    directory = save_head(quick_head(tiny_target, "eagle3"), tmp_path / "head", training=training)
    capsys.readouterr()
    load_head(directory, off)
    assert capsys.readouterr().err == ""
    on = thinking_target(True)
    for _ in range(2):
        load_head(directory, on)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and err.count("\n") == 1
    assert f"head {directory} was trained on" in err and "thinking off" in err and "set model.thinking=false" in err
    load_head(directory, tiny_target)  # ChatML: another template
    assert "thinking at the template's default" in capsys.readouterr().err
    config = json.loads((directory / "config.json").read_text())
    del config["training"]["chat"]
    (directory / "config.json").write_text(json.dumps(config))
    load_head(directory, on)
    assert capsys.readouterr().err == ""
    shipped = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-eagle3"
    assert head_chat_mismatch(shipped, read_head_config(shipped), on.tokenizer) is None


def test_the_embedded_target_is_named_as_a_dequantized_q4_1_gguf():
    how = loaded_as(ModelConfig(), torch.float32)
    assert how["source"] == "embedded:smollm2" and how["quantization"] == "Q4_1"
    assert how["loaded_as"] == "GGUF Q4_1 dequantized to float32"
    assert how["original"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not any(str(v).startswith("/") for v in how.values())


def test_draft_dtype_halves_the_head_only_on_an_fp32_cpu_target_with_native_bf16(tiny_target, monkeypatch):
    from specheads.heads import HEADS, io

    eagle3 = quick_head(tiny_target, "eagle3")
    # Medusa-2 only by its class's flag: building one would fold its LoRA into the shared target
    medusa2 = types.SimpleNamespace(adapts_target=HEADS["medusa2"].adapts_target)
    monkeypatch.setattr(io, "native_bf16_cpu", lambda: True)
    assert io.draft_dtype("auto", tiny_target, eagle3) == torch.bfloat16
    assert io.draft_dtype("auto", tiny_target, medusa2) == torch.float32  # its LoRA adapts the target
    assert io.draft_dtype("target", tiny_target, eagle3) == torch.float32
    assert io.draft_dtype("float16", tiny_target, eagle3) == torch.float16
    monkeypatch.setattr(io, "native_bf16_cpu", lambda: False)  # emulated bf16 can be slower than fp32
    assert io.draft_dtype("auto", tiny_target, eagle3) == torch.float32
    assert io.draft_dtype("bfloat16", tiny_target, eagle3) == torch.bfloat16
    assert io.draft_dtype("int8", tiny_target, eagle3) == torch.float32  # its activations: as under auto
    monkeypatch.setattr(io, "native_bf16_cpu", lambda: True)
    assert io.draft_dtype("int8", tiny_target, eagle3) == torch.bfloat16
    with pytest.raises(SpecHeadsError, match="head_dtype"):
        io.draft_dtype("int4", tiny_target, eagle3)


def test_int8_drafting_quantizes_the_heads_own_layers_and_routes_no_target_kernel(tiny_target, monkeypatch):
    from specheads.heads import io
    from specheads.kernels import linear_layout, weight_int8

    monkeypatch.setattr(io, "native_bf16_cpu", lambda: True)
    head = quick_head(tiny_target, "eagle3")
    io.prepare_for_drafting(head, "int8", tiny_target)
    assert head.dtype == torch.bfloat16 and weight_int8.installed(head)
    assert io.draft_precision(head) == "int8/bfloat16"
    assert not weight_int8.installed(tiny_target.model)  # the target's weights are never touched
    io.route_draft_kernels(head, linear_layout.RowLayouts.everywhere(linear_layout.WEIGHT_LEFT))
    assert all(not hasattr(layer, "_row_layouts") for layer in linear_layout.linear_layers(head))
    saved = head.state_dict()
    assert all(v.dtype == torch.bfloat16 for v in saved.values() if v.is_floating_point())  # int8 copies: not saved
    plain = quick_head(tiny_target, "eagle3")
    io.prepare_for_drafting(plain, "bfloat16", tiny_target)
    assert io.draft_precision(plain) == "bfloat16" and not weight_int8.installed(plain)


def test_auto_drafts_on_int8_weights_exactly_where_it_drafts_in_bf16(tiny_target, monkeypatch):
    from specheads.heads import HEADS, io

    eagle3 = quick_head(tiny_target, "eagle3")
    medusa2 = types.SimpleNamespace(adapts_target=HEADS["medusa2"].adapts_target)
    monkeypatch.setattr(io, "native_bf16_cpu", lambda: True)
    assert io.int8_weights("auto", tiny_target, eagle3) and io.int8_weights("int8", tiny_target, eagle3)
    assert not io.int8_weights("auto", tiny_target, medusa2)  # its LoRA adapts the target
    assert not io.int8_weights("bfloat16", tiny_target, eagle3) and not io.int8_weights("target", tiny_target, eagle3)
    io.prepare_for_drafting(eagle3, "auto", tiny_target)
    assert io.draft_precision(eagle3) == "int8/bfloat16"
    monkeypatch.setattr(io, "native_bf16_cpu", lambda: False)  # emulated bf16: the target's dtype, its weights
    assert not io.int8_weights("auto", tiny_target, eagle3) and io.int8_weights("int8", tiny_target, eagle3)
