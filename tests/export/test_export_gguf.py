"""format=gguf: an EAGLE-3 head as llama.cpp's draft GGUF, read back with the gguf package: every
tensor is the head's (q/k rows in llama.cpp's RoPE order), the keys are the ones llama.cpp's loader
reads, d2t holds absolute ids; what llama.cpp cannot serve is refused in one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from test_export import EAGLE3, compose_export, edit_config, make_head_dir
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specheads.errors import SpecHeadsError
from specheads.export import export_head, formats_for
from specheads.export import gguf as fmt
from specheads.export.common import HeadSource, TargetParts
from specheads.export.validate_gguf import llamacpp_eagle3
from specheads.tiny import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# our name -> llama.cpp's, written out here again so that a wrong mapping in the module shows
NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
CHAIN = [[0], [0, 0], [0, 0, 0]]


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny targets' byte tokenizer with one merge: a BPE vocabulary as real targets have."""
    spec = json.loads(byte_tokenizer().backend_tokenizer.to_str())
    spec["model"]["vocab"]["ab"] = 300
    spec["model"]["merges"] = [["a", "b"]]
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


@pytest.fixture(scope="module")
def target():
    return SimpleNamespace(tokenizer=merging_tokenizer())


def chain_head(tiny_target, directory: Path, **overrides) -> Path:
    make_head_dir(tiny_target, directory, "eagle3", **{**EAGLE3, **overrides})
    edit_config(directory, lambda c: c.update(default_tree=CHAIN))
    return directory


def read(path: Path) -> tuple[dict, dict]:
    reader = GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def as_torch(t) -> torch.Tensor:
    shape = [int(n) for n in reversed(t.shape.tolist())]
    return torch.from_numpy(np.array(t.data)).reshape(shape)


# -- RoPE: what llama.cpp computes with the file's rows is what the head computes with its own -------


def hf_scores(q, k, pos, theta=10000.0):
    """Per-head q.k after Hugging Face Llama's RoPE (rotate the two halves)."""
    d = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    q, k = apply_rotary_pos_emb(q.double(), k.double(), cos, sin, unsqueeze_dim=0)
    return q @ k.transpose(-1, -2)


def norm_scores(q, k, pos, theta=10000.0):
    """Per-head q.k after llama.cpp's LLAMA_ROPE_TYPE_NORM (rotate adjacent pairs), written out."""
    d = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]

    def rope(x):
        x = x.double()
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * ang.cos() - b * ang.sin()
        out[..., 1::2] = a * ang.sin() + b * ang.cos()
        return out

    return rope(q) @ rope(k).transpose(-1, -2)


def heads_of(wq, wk, x, info):
    """q [heads, T, d] and k repeated to the q heads (GQA) from projection rows."""
    d, nh, nkv = info.head_dim, info.num_attention_heads, info.num_key_value_heads
    q = (x @ wq.T).reshape(-1, nh, d).transpose(0, 1)
    k = (x @ wk.T).reshape(-1, nkv, d).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    return q, k


def test_qk_rows_rotate_as_llamacpp_rotates(tiny_target, tmp_path, target):
    src = HeadSource.read(chain_head(tiny_target, tmp_path / "head"))
    export_head(src, "gguf", tmp_path / "d.gguf", target=target)
    _, tensors = read(tmp_path / "d.gguf")
    info = src.info
    x, pos = torch.randn(5, 2 * info.hidden_size), torch.arange(5) + 7
    wq, wk = src.tensors["layers.0.self_attn.q_proj.weight"], src.tensors["layers.0.self_attn.k_proj.weight"]
    expected = hf_scores(*heads_of(wq, wk, x, info), pos)
    fq, fk = as_torch(tensors["blk.0.attn_q.weight"]), as_torch(tensors["blk.0.attn_k.weight"])
    torch.testing.assert_close(norm_scores(*heads_of(fq, fk, x, info), pos), expected)
    # the wrong variant: the head's rows as they are give llama.cpp other attention
    assert not torch.allclose(norm_scores(*heads_of(wq, wk, x, info), pos), expected, atol=1e-3)


# -- the round trip ---------------------------------------------------------------------------------


def test_round_trip_holds_the_head_as_llamacpp_reads_it(tiny_target, tmp_path, target):
    src = HeadSource.read(chain_head(tiny_target, tmp_path / "head"))
    result = export_head(src, "gguf", tmp_path / "d.gguf", target=target)
    assert result.engines == ["llama.cpp"] and result.findings == {"llama.cpp": []}
    assert "--spec-draft-n-max 3" in result.notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "head"]  # no temp file left
    kv, tensors = read(tmp_path / "d.gguf")
    info, spec = src.info, src.spec
    assert kv["general.architecture"] == "eagle3" and kv["general.file_type"] == 0
    assert kv["eagle3.target_layers"] == [1, 3, 5] and kv["eagle3.block_count"] == 1
    assert kv["eagle3.target_hidden_size"] == info.hidden_size == kv["eagle3.embedding_length"]
    assert kv["eagle3.feed_forward_length"] == spec.intermediate_size
    assert (kv["eagle3.attention.head_count"], kv["eagle3.attention.head_count_kv"]) == (4, 2)
    assert kv["eagle3.norm_before_residual"] is False and kv["eagle3.norm_before_fc"] is False
    assert kv["eagle3.vocab_size"] == info.vocab_size == len(kv["tokenizer.ggml.tokens"])
    tok = target.tokenizer
    ids = {i: t for t, i in tok.get_vocab().items()}
    assert kv["tokenizer.ggml.tokens"] == [ids.get(i, f"[PAD{i}]") for i in range(info.vocab_size)]
    types = kv["tokenizer.ggml.token_type"]
    assert types[tok.convert_tokens_to_ids("<|im_end|>")] == 3 and types[97] == 1 and types[-1] == 5
    assert kv["tokenizer.ggml.merges"] == ["a b"] and kv["tokenizer.ggml.model"] == "gpt2"
    # d2t: absolute target ids (what eagle3.cpp scatters the logits to), t2d not written
    d2t = src.tensors["d2t"]
    assert torch.equal(as_torch(tensors["d2t"]), torch.arange(96) + d2t) and bool(d2t.any())
    assert "t2d" not in tensors and "token_embd.weight" not in tensors
    heads = {"layers.0.self_attn.q_proj.weight": 4, "layers.0.self_attn.k_proj.weight": 2}
    for ours, theirs in NAMES.items():
        got = as_torch(tensors[theirs])
        if ours in heads:  # rows back from adjacent pairs to two halves per head
            n = heads[ours]
            got = got.reshape(n, -1, 2, got.shape[-1]).transpose(1, 2).reshape(got.shape)
        assert torch.equal(got, src.tensors[ours]), ours
    assert set(tensors) == {*NAMES.values(), "d2t"}
    assert llamacpp_eagle3(tmp_path / "d.gguf") == []
    assert json.loads(kv["specheads.provenance"])["head_config"] == src.config


def test_float16_and_float32(tiny_target, tmp_path, target):
    src = HeadSource.read(chain_head(tiny_target, tmp_path / "head"))
    kinds = {}
    for dtype in ("float32", "float16", "bfloat16"):
        export_head(src, "gguf", tmp_path / f"{dtype}.gguf", dtype=dtype, target=target)
        kv, tensors = read(tmp_path / f"{dtype}.gguf")
        kinds[dtype] = (kv["general.file_type"], tensors["fc.weight"].tensor_type, tensors["output.weight"].tensor_type)
        # norms stay F32 as llama.cpp's converter keeps them; they hold the head's values
        assert tensors["output_norm.weight"].tensor_type == GGMLQuantizationType.F32
        assert torch.equal(as_torch(tensors["output_norm.weight"]), src.tensors["norm.weight"])
    assert kinds == {
        "float32": (0, GGMLQuantizationType.F32, GGMLQuantizationType.F32),
        "float16": (1, GGMLQuantizationType.F16, GGMLQuantizationType.F16),
        "bfloat16": (32, GGMLQuantizationType.BF16, GGMLQuantizationType.BF16),
    }
    _, half = read(tmp_path / "float16.gguf")
    assert torch.equal(as_torch(half["fc.weight"]), src.tensors["fc.weight"].half())
    assert (tmp_path / "float16.gguf").stat().st_size < 0.75 * (tmp_path / "float32.gguf").stat().st_size


def test_norm_variants_llamacpp_implements(tiny_target, tmp_path, target):
    src = HeadSource.read(chain_head(tiny_target, tmp_path / "head", norm_before_fc=True, norm_before_residual=True))
    export_head(src, "gguf", tmp_path / "d.gguf", target=target)
    kv, tensors = read(tmp_path / "d.gguf")
    assert kv["eagle3.norm_before_fc"] is True and kv["eagle3.norm_before_residual"] is True
    assert torch.equal(as_torch(tensors["enc.output_norm.weight"]), src.tensors["fc_input_norm.weight"])


def test_llama3_rope_becomes_rope_freqs(tiny_target, tmp_path, target):
    head = chain_head(tiny_target, tmp_path / "head")
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=1024)
    edit_config(head, lambda c: c["target"].update(rope_parameters=rope))
    export_head(head, "gguf", tmp_path / "d.gguf", target=target)
    kv, tensors = read(tmp_path / "d.gguf")
    freqs = as_torch(tensors["rope_freqs.weight"])
    # the fastest frequencies are kept, the slowest divided by the factor (Llama 3.1's scaling)
    assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == pytest.approx(8.0)
    assert kv["eagle3.rope.freq_base"] == 500000.0


def target_gguf(path: Path, tokens: list[str]) -> Path:
    """A target GGUF's vocabulary (llama.cpp's own keys, a pre-tokenizer name the converter found)."""
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_target_gives_its_own_vocabulary(tiny_target, tmp_path):
    head = chain_head(tiny_target, tmp_path / "head")
    tokens = [f"t{i}" for i in range(320)]
    export_head(head, "gguf", tmp_path / "d.gguf", target_gguf=target_gguf(tmp_path / "target.gguf", tokens))
    kv, _ = read(tmp_path / "d.gguf")
    assert kv["tokenizer.ggml.tokens"] == tokens and kv["tokenizer.ggml.pre"] == "smollm"
    assert kv["tokenizer.ggml.eos_token_id"] == 2
    with pytest.raises(SpecHeadsError, match="holds 300 tokens, the head's target 320"):
        export_head(head, "gguf", tmp_path / "x.gguf", target_gguf=target_gguf(tmp_path / "t2.gguf", tokens[:300]))


# -- refusals ---------------------------------------------------------------------------------------


def refusals(tiny_target, tmp_path, target):
    chain = chain_head(tiny_target, tmp_path / "chain")
    yarn = chain_head(tiny_target, tmp_path / "yarn")
    edit_config(yarn, lambda c: c["target"].update(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    plain = SimpleNamespace(tokenizer=byte_tokenizer())
    return [
        (chain_head(tiny_target, tmp_path / "two", layer_ids=[2, 3]), {}, "fuses exactly 3 target layers"),
        (chain_head(tiny_target, tmp_path / "last", layer_ids=[1, 3, 6]), {}, "input of target layers 0..5"),
        (chain_head(tiny_target, tmp_path / "bias", fc_bias=True), {}, "fc bias"),
        (chain_head(tiny_target, tmp_path / "out", norm_output=True), {}, "norm_output=true"),
        (chain_head(tiny_target, tmp_path / "deep", num_decoder_layers=2), {}, "one decoder layer"),
        (make_head_dir(tiny_target, tmp_path / "tree", "eagle3", **EAGLE3), {}, "pass num_speculative_tokens=K"),
        (make_head_dir(tiny_target, tmp_path / "pe", "peagle"), {}, "no parallel drafting"),
        (chain, {"target": None}, "needs the target's tokenizer: pass model=NAME"),
        (chain, {"target": plain}, "no merges"),
        (chain, {"engine": "vllm"}, "read by llama.cpp; engine=vllm"),
        (yarn, {}, "RoPE is 'yarn'"),
    ]


def test_each_refusal_is_one_line_and_writes_nothing(tiny_target, tmp_path, target):
    for head, kwargs, message in refusals(tiny_target, tmp_path, target):
        out = tmp_path / "refused" / "d.gguf"
        with pytest.raises(SpecHeadsError, match=message) as err:
            export_head(head, "gguf", out, **{"target": target, **kwargs})
        assert "\n" not in str(err.value), message
        assert not out.parent.exists() or not any(out.parent.iterdir()), message


def test_a_branching_tree_exports_as_the_chain_asked_for(tiny_target, tmp_path, target):
    head = make_head_dir(tiny_target, tmp_path / "tree", "eagle3", **EAGLE3)
    result = export_head(head, "gguf", tmp_path / "d.gguf", target=target, num_speculative_tokens=2)
    assert "--spec-draft-n-max 2" in result.notes[0] and "default tree is not used" in result.notes[1]
    kv, _ = read(tmp_path / "d.gguf")
    assert json.loads(kv["specheads.provenance"])["num_speculative_tokens"] == 2


@pytest.mark.parametrize(
    "wrong, error, message",
    [
        ("qk_unpermuted", RuntimeError, "tensor layers.0.self_attn.k_proj.weight does not read back"),
        ("d2t_offsets", SpecHeadsError, "offsets instead of ids"),
    ],
)
def test_a_wrong_variant_is_caught_and_nothing_written(
    tiny_target, tmp_path, target, monkeypatch, wrong, error, message
):
    """q/k rows left in Hugging Face's order read back as other weights (llama.cpp would rotate
    the wrong pairs); d2t left as offsets (the safetensors formats' meaning) fails llama.cpp's contract."""
    head = chain_head(tiny_target, tmp_path / "head")
    build = fmt.build

    def offsets(src, opts):
        draft = build(src, opts)
        draft.tensors["d2t"] = (src.tensors["d2t"].numpy().astype(np.int64), GGMLQuantizationType.I64)
        return draft

    if wrong == "qk_unpermuted":
        monkeypatch.setattr(fmt, "rope_rows", lambda weight, heads: weight)
    else:
        monkeypatch.setattr(fmt, "build", offsets)
    with pytest.raises(error, match=message):
        export_head(head, "gguf", tmp_path / "out" / "d.gguf", target=target)
    assert not any((tmp_path / "out").iterdir())


def test_the_contract_flags_what_llamacpp_would_refuse(tiny_target, tmp_path, target):
    src = HeadSource.read(chain_head(tiny_target, tmp_path / "head"))
    opts = SimpleNamespace(
        engine="auto", dtype="auto", embeddings=None, num_speculative_tokens=None, target=TargetParts(lambda: target)
    )

    def problems(change) -> list[str]:
        draft = fmt.build(src, opts)
        change(draft)
        fmt.write(draft, tmp_path / "bad.gguf")
        return llamacpp_eagle3(tmp_path / "bad.gguf")

    def replace(key, value, kind, sub=None):
        return lambda d: d.fields.__setitem__(
            next(i for i, f in enumerate(d.fields) if f[0] == key), (key, value, kind, sub)
        )

    assert problems(lambda d: None) == []
    assert any(
        "exactly 3" in p
        for p in problems(replace("eagle3.target_layers", [1, 3], GGUFValueType.ARRAY, GGUFValueType.INT32))
    )
    assert any("UINT32" in p for p in problems(replace("eagle3.target_hidden_size", 64, GGUFValueType.INT32)))
    assert any(
        "merges" in p
        for p in problems(
            lambda d: d.fields.pop(next(i for i, f in enumerate(d.fields) if f[0] == "tokenizer.ggml.merges"))
        )
    )
    assert any(
        "missing tensor blk.0.attn_norm_2" in p for p in problems(lambda d: d.tensors.pop("blk.0.attn_norm_2.weight"))
    )
    offsets = src.tensors["d2t"].numpy().astype(np.int64) * 0 + 3  # duplicates: offsets, not ids
    assert any(
        "distinct absolute" in p for p in problems(lambda d: d.tensors.update(d2t=(offsets, GGMLQuantizationType.I64)))
    )


# -- the command ------------------------------------------------------------------------------------


def test_the_export_job_writes_one_file(tiny_target, tmp_path, capsys):
    from specheads.export.job import run_export

    assert "gguf" in formats_for("eagle3") and "gguf" not in formats_for("peagle")
    head = chain_head(tiny_target, tmp_path / "head")
    vocab = target_gguf(tmp_path / "target.gguf", [f"t{i}" for i in range(320)])
    args = [f"head_path={head}", "format=gguf", "model=tiny-random", f"model.path={vocab}"]
    result = run_export(compose_export([*args, f"out={tmp_path / 'd.gguf'}", "dtype=float16"]))
    assert result.path == tmp_path / "d.gguf" and read(result.path)[0]["general.file_type"] == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "llama.cpp: ok" and lines[-1] == str(tmp_path / "d.gguf")
    with pytest.raises(SpecHeadsError, match="writes one file: give out=FILE.gguf"):
        run_export(compose_export([*args, "push_to_hub=true", "repo_id=me/x"]))
    with pytest.raises(SpecHeadsError, match="is a directory; format gguf writes one file"):
        run_export(compose_export([*args, f"out={tmp_path}"]))
