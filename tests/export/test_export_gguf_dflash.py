"""format=gguf for the DFlash family: a DFlash, DSpark or DFlash2 head as llama.cpp's draft GGUF of
architecture `dflash`, read back with the gguf package: every tensor is the head's under llama.cpp's
name (q/k rows as trained: llama.cpp rotates this draft NeoX-style), the one k_norm in every layer,
the keys llama.cpp's loader and its draft-dflash / draft-dspark runtime read, the mask token id;
what llama.cpp cannot draft as trained is refused in one line, nothing written.

The last test needs llama.cpp's build (`make engines`; skipped without it): llama-speculative-simple
drafts, from our export on the embedded target, the tokens our head drafts at every block slot."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from test_export import edit_config, make_head_dir
from test_export_gguf import merging_tokenizer

from specheads.errors import SpecHeadsError
from specheads.export import export_head, formats_for
from specheads.export import gguf as fmt
from specheads.export.common import HeadSource, TargetParts
from specheads.export.validate_gguf import llamacpp_dflash

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
SPECULATIVE = ROOT / ".llamacpp" / "build" / "bin" / "llama-speculative-simple"
# our names -> llama.cpp's, written out again here so that a wrong mapping in the module shows
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}
DSPARK_NAMES = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
DFLASH2_NAMES = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
DFLASH2_LAYER_NAMES = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
SMALL = {
    "dflash": dict(block_size=4, mask_token_id=7),
    "dspark": dict(block_size=4, markov_rank=8, mask_token_id=7),
    "dflash2": dict(block_size=5, conv_kernel_size=3, selector_rank=8, selector_top_k=6, mask_token_id=7),
}


@pytest.fixture(scope="module")
def target():
    return SimpleNamespace(tokenizer=merging_tokenizer())


def block_head(tiny_target, directory: Path, family: str, **overrides) -> Path:
    return make_head_dir(tiny_target, directory, family, **{**SMALL[family], **overrides})


def read(path: Path) -> tuple[dict, dict]:
    reader = GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def as_torch(t) -> torch.Tensor:
    shape = [int(n) for n in reversed(t.shape.tolist())]
    return torch.from_numpy(np.array(t.data)).reshape(shape)


def expected_names(src: HeadSource) -> dict[str, str]:
    layers = src.spec.dflash_layers
    per_layer = {**LAYER_NAMES, **(DFLASH2_LAYER_NAMES if src.family == "dflash2" else {})}
    names = {f"layers.{i}.{ours}": f"blk.{i}.{theirs}" for i in range(layers) for ours, theirs in per_layer.items()}
    names.update(NAMES)
    names.update({"dspark": DSPARK_NAMES, "dflash2": DFLASH2_NAMES}.get(src.family, {}))
    return names


@pytest.mark.parametrize("family", ["dflash", "dspark", "dflash2"])
def test_round_trip_holds_the_head_as_llamacpp_reads_it(tiny_target, tmp_path, target, family):
    src = HeadSource.read(block_head(tiny_target, tmp_path / "head", family))
    assert "gguf" in formats_for(family)
    result = export_head(src, "gguf", tmp_path / "d.gguf", target=target)
    assert result.engines == ["llama.cpp"] and result.findings == {"llama.cpp": []}
    spec, info = src.spec, src.info
    full = spec.block_size if family == "dspark" else spec.block_size - 1  # sample_from_anchor: slot 0 drafts
    kind = "draft-dspark" if family == "dspark" else "draft-dflash"
    assert f"--spec-type {kind} --spec-draft-n-max {full} " in result.notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "head"]
    kv, tensors = read(tmp_path / "d.gguf")
    a = "dflash"
    assert kv["general.architecture"] == a and kv["general.file_type"] == 0
    assert kv[f"{a}.target_layers"] == src.layer_ids and kv[f"{a}.block_count"] == spec.dflash_layers
    assert kv[f"{a}.embedding_length"] == info.hidden_size and kv[f"{a}.block_size"] == spec.block_size
    assert kv[f"{a}.attention.causal"] is False
    assert (kv[f"{a}.attention.head_count"], kv[f"{a}.attention.head_count_kv"]) == (4, 2)
    assert kv[f"{a}.attention.key_length"] == info.head_dim == kv[f"{a}.attention.value_length"]
    assert kv["tokenizer.ggml.mask_token_id"] == 7 and len(kv["tokenizer.ggml.tokens"]) == info.vocab_size
    if family == "dspark":  # both written: llama.cpp reads an absent one as true
        assert kv[f"{a}.sample_from_anchor"] is True and kv[f"{a}.has_confidence_head"] is True
    else:
        assert f"{a}.sample_from_anchor" not in kv and f"{a}.has_confidence_head" not in kv
    if family == "dflash2":
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            assert kv[f"{a}.{name}"] == getattr(spec, name), name
    names = expected_names(src)
    for ours, theirs in names.items():
        assert torch.equal(as_torch(tensors[theirs]), src.tensors[ours]), ours  # q/k rows unpermuted
    for i in range(spec.dflash_layers):
        assert torch.equal(as_torch(tensors[f"blk.{i}.attn_k_norm.weight"]), src.tensors["k_norm.weight"])
    k_norms = {f"blk.{i}.attn_k_norm.weight" for i in range(spec.dflash_layers)}
    assert set(tensors) == {*names.values(), *k_norms}  # llama.cpp refuses a file with any other
    assert not {"token_embd.weight", "output.weight", "d2t"} & set(tensors)  # the target's are shared
    assert llamacpp_dflash(tmp_path / "d.gguf") == []
    assert json.loads(kv["specheads.provenance"])["head_config"] == src.config
    back = fmt.read_file(tmp_path / "d.gguf")
    assert back.family == family and back.spec["layer_ids"] == src.layer_ids


def test_float16_keeps_norms_and_convolution_kernels_f32(tiny_target, tmp_path, target):
    src = HeadSource.read(block_head(tiny_target, tmp_path / "head", "dflash2"))
    export_head(src, "gguf", tmp_path / "d.gguf", target=target, dtype="float16")
    kv, tensors = read(tmp_path / "d.gguf")
    assert kv["general.file_type"] == 1
    f32, f16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
    assert tensors["blk.0.attn_conv_base"].tensor_type == f32 == tensors["blk.0.attn_k_norm.weight"].tensor_type
    assert tensors["blk.0.attn_q.weight"].tensor_type == f16 == tensors["selector_hidden.weight"].tensor_type
    assert torch.equal(as_torch(tensors["blk.0.ffn_conv_base"]), src.tensors["layers.0.mlp_conv.base_kernel"])


def test_a_dspark_head_without_sample_from_anchor_drafts_one_short(tiny_target, tmp_path, target):
    head = block_head(tiny_target, tmp_path / "head", "dspark", sample_from_anchor=False, enable_confidence_head=False)
    result = export_head(head, "gguf", tmp_path / "d.gguf", target=target)
    assert "--spec-draft-n-max 3 " in result.notes[0]
    kv, tensors = read(tmp_path / "d.gguf")
    assert kv["dflash.sample_from_anchor"] is False and kv["dflash.has_confidence_head"] is False
    assert "conf_proj.weight" not in tensors


def refusals(tiny_target, tmp_path):
    last = block_head(tiny_target, tmp_path / "last", "dflash")
    edit_config(last, lambda c: c.update(layer_ids=[3, 6]))
    return [
        (last, {}, r"input of target layers 0\.\.5"),
        (block_head(tiny_target, tmp_path / "gated", "dspark", markov_head_type="gated"), {}, "no gate_proj"),
        (
            block_head(tiny_target, tmp_path / "conf", "dspark", confidence_head_with_markov=False),
            {},
            "confidence_head_with_markov=true",
        ),
        (block_head(tiny_target, tmp_path / "wide", "dflash2", selector_top_k=8), {}, "lattice"),
        (block_head(tiny_target, tmp_path / "short", "dflash"), {"num_speculative_tokens": 2}, "serve it with 3"),
        (block_head(tiny_target, tmp_path / "emb", "dflash"), {"embeddings": True}, "without embeddings"),
        (block_head(tiny_target, tmp_path / "vllm", "dspark"), {"engine": "vllm"}, "read by llama.cpp"),
    ]


def test_each_refusal_is_one_line_and_writes_nothing(tiny_target, tmp_path, target):
    for head, kwargs, message in refusals(tiny_target, tmp_path):
        out = tmp_path / "refused" / "d.gguf"
        with pytest.raises(SpecHeadsError, match=message) as err:
            export_head(head, "gguf", out, **{"target": target, **kwargs})
        assert "\n" not in str(err.value), message
        assert not out.parent.exists() or not any(out.parent.iterdir()), message


def test_the_contract_flags_what_llamacpp_would_refuse_or_run_wrongly(tiny_target, tmp_path, target):
    src = HeadSource.read(block_head(tiny_target, tmp_path / "head", "dspark"))
    opts = SimpleNamespace(
        engine="auto", dtype="auto", embeddings=None, num_speculative_tokens=None, target=TargetParts(lambda: target)
    )

    def problems(change) -> list[str]:
        draft = fmt.build(src, opts)
        change(draft)
        fmt.write(draft, tmp_path / "bad.gguf")
        return llamacpp_dflash(tmp_path / "bad.gguf")

    def drop(key):
        return lambda d: d.fields.pop(next(i for i, f in enumerate(d.fields) if f[0] == key))

    assert problems(lambda d: None) == []
    assert any("missing key dflash.sample_from_anchor" in p for p in problems(drop("dflash.sample_from_anchor")))
    assert any("mask_token_id" in p for p in problems(drop("tokenizer.ggml.mask_token_id")))
    assert any("causal must be written false" in p for p in problems(drop("dflash.attention.causal")))
    extra = (np.zeros(4, dtype=np.float32), GGMLQuantizationType.F32)
    assert any("does not load" in p for p in problems(lambda d: d.tensors.update({"output.bias": extra})))
    assert any(
        "missing tensor blk.1.attn_k_norm" in p for p in problems(lambda d: d.tensors.pop("blk.1.attn_k_norm.weight"))
    )
    assert any(
        "has_confidence_head" in p
        for p in problems(lambda d: [d.tensors.pop("conf_proj.weight"), d.tensors.pop("conf_proj.bias")])
    )
    hyper = ("dflash.hyper_connection.count", 4, GGUFValueType.UINT32, None)
    assert any("another draft graph" in p for p in problems(lambda d: d.fields.append(hyper)))


# -- the slot convention, against llama.cpp's own forward ----------------------------------------------

DRAFTED = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+) ")
VERIFIED = re.compile(r"accepted \d+/\d+ draft tokens, the last target token is: \((\d+)\)")


@pytest.mark.skipif(not SPECULATIVE.is_file(), reason="llama.cpp is not built (make engines builds it)")
@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_llamacpp_drafts_our_tokens_at_every_block_slot(tmp_path, family):
    """llama-speculative-simple, from our export on the embedded target's own GGUF, drafts at every
    slot of its first block the token our head's top-1 chain drafts from the same context (the
    prompt, the bonus token its last one): a block numbered one slot apart (sglang#30852) or another
    block length (vllm#41834) drafts other tokens. The head is random (llama.cpp's 8-bit activations
    could flip a near tie; none is at these slots). llama.cpp prints no DFlash2 draft tokens (its
    selector walk logs nothing): engines/llamacpp.py holds a trained DFlash2 head's acceptance there
    to our replay's instead."""
    from specheads.config.train import HeadConfig, ModelConfig
    from specheads.heads import build_head, save_head
    from specheads.target import gguf_file_of, load_target

    cfg = ModelConfig(path="embedded:smollm2", dtype="float32")
    smollm = load_target(cfg, torch.device("cpu"))
    overrides = {"dflash2": {"selector_top_k": 4}, "dspark": {"markov_rank": 16}}.get(family, {})
    torch.manual_seed(0)
    head = build_head(HeadConfig(family=family, block_size=4, dflash_layers=1, **overrides), smollm, train_rows=8)
    save_head(head, tmp_path / "head", training={"steps": 0, "data": "none"})
    export_head(tmp_path / "head", "gguf", tmp_path / "d.gguf", target_gguf=gguf_file_of(cfg), target=smollm)
    text = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    ids = smollm.tokenizer(text, add_special_tokens=False)["input_ids"]
    k = head.max_draft_depth(head.spec)
    cmd = [SPECULATIVE, "-m", gguf_file_of(cfg), "-md", tmp_path / "d.gguf", "--spec-draft-n-max", k]
    cmd += ["--spec-draft-p-min", "0", "-p", text, "-n", "4", "--temp", "0", "-t", "1", "-td", "1", "-v", "--no-repack"]
    log = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, check=True).stderr
    first = [int(t) for pos, t in DRAFTED.findall(log.split("accepted", 1)[0])]
    assert VERIFIED.search(log), "llama.cpp verified no draft"
    prompt = torch.tensor([ids])
    s = smollm.states(prompt, layer_ids=head.target_layer_ids(), final=False)
    features = head.input_features(s.hidden)
    with torch.no_grad():
        if family == "dflash":  # each slot on its own: the block's top-1 per slot
            h = head.block_states(prompt[:, 1:], features[:, :-1], head.new_cache())
            ours = head.draft_logits(h[0, 1:]).argmax(-1).tolist()
        else:  # each slot after the token drafted before it
            ours, _ = head.draft_block(prompt[:, 1:], features[:, :-1], head.new_cache(), k).chain(ids[-1])
    assert len(first) == k == len(ours)  # every slot of the block, counted
    assert first == ours
