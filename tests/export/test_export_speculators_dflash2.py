"""Format speculators for a DFlash2 head (speculators' `dflash2` type, vLLM's DFlash2DraftModel).

The engines read our export with their own code (marker `engines`: scripts run in vLLM's virtualenv
.venv-vllm, which `make engines` builds; skipped without it): speculators' DFlash2 config class and
model, vLLM's config reader, its model class (built on CPU past the model-runner check its CPU build
fails) and weight loader, and the plain-torch convolution and selector functions of its
qwen3_dflash2.py. Without an engine: the round trip through our loader drafts the same tokens, and
wrong variants are refused in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import ROWS, edit_config

from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.export import check_directory, export_head, load_exported, open_head
from specheads.export.speculators_dflash2 import vllm_view
from specheads.heads import build_head, load_head, save_head
from specheads.heads.dflash2 import DFlash2Head

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_engines = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)"
)

SMALL = dict(block_size=5, conv_kernel_size=3, selector_rank=8, selector_top_k=6, dflash_layers=3, mask_token_id=7)
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
ANCHOR = 12  # the bonus token's position in IDS: the context is the target's states at 0..11
IDS = torch.randint(10, 300, (1, 24), generator=torch.Generator().manual_seed(1))


def dflash2_dir(target, directory: Path, seed: int = 0, **overrides) -> Path:
    """A DFlash2 head off its initialisation, its selector with a say over the drafted tokens."""
    torch.manual_seed(seed)
    head = build_head(HeadConfig(family="dflash2", **{**SMALL, **overrides}), target, train_rows=ROWS)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
        head.candidate_selector.hidden_projection.weight.normal_(0, 0.5)
    save_head(head, directory)
    return directory


def drafts(head, target, ids: torch.Tensor = IDS, anchor: int = ANCHOR) -> tuple[list[int], torch.Tensor]:
    """What the head drafts after ids[:, :anchor + 1] (the bonus token ids[0, anchor]): one block on the
    target's states at 0..anchor-1, walked greedily as vLLM walks it: the tokens [K] and logits [K, V]."""
    s = target.states(ids, layer_ids=head.target_layer_ids(), final=False)
    features = head.input_features(s.hidden)[:, :anchor]
    with torch.no_grad():
        block = head.draft_block(ids[:, 1 : anchor + 1], features, head.new_cache(), head.spec.block_size - 1)
        return block.chain(int(ids[0, anchor]))


# -- our own loader ---------------------------------------------------------------------------------


def test_round_trip_drafts_the_same_tokens(tiny_target, tmp_path):
    src = dflash2_dir(tiny_target, tmp_path / "head")
    result = export_head(src, "speculators", tmp_path / "out")
    assert result.engines == ["vllm", "speculators"] and result.findings == {"vllm": [], "speculators": []}
    original = load_head(src, tiny_target)
    spec = original.spec
    config = json.loads((result.path / "config.json").read_text())
    assert "model_type" not in config  # vLLM reads a config without one, with speculators_config, as speculators'
    assert config["architectures"] == ["DFlash2DraftModel"] and config["speculators_model_type"] == "dflash2"
    assert config["speculators_config"]["algorithm"] == "dflash2"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == spec.block_size - 1
    assert {k: config[k] for k in FIELDS} == {k: getattr(spec, k) for k in FIELDS}
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    assert vllm_view(config)["architectures"] == ["DFlash2DraftModel"]
    assert vllm_view(config)["dflash_config"] == {  # what algos.update_dflash2 builds
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": [k - 1 for k in spec.layer_ids],
        "sample_from_anchor": False,
        "causal": False,
        **{k: getattr(spec, k) for k in FIELDS},
    }
    exported = open_head(result.path, tiny_target)
    assert type(exported) is DFlash2Head and exported.spec.block_size == spec.block_size
    assert {k: getattr(exported.spec, k) for k in FIELDS} == {k: getattr(spec, k) for k in FIELDS}
    before, after = drafts(original, tiny_target), drafts(exported, tiny_target)
    assert before[0] == after[0] and torch.equal(before[1], after[1])
    edit_config(result.path, lambda c: c.pop("specheads"))  # the engine fields alone give the same head
    alone = drafts(load_exported(result.path, tiny_target), tiny_target)
    assert alone[0] == before[0] and torch.equal(alone[1], before[1])


def set_tokens(k):
    return lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=k)


@pytest.mark.parametrize(
    "change, message, vllm_finds",
    [
        (set_tokens(3), "serve it with 4", "speculative_tokens must be block_size - 1"),
        (lambda c: c.pop("selector_rank"), "selector_rank 256 does not fit", "selector_rank must be written"),
        (lambda c: c.update(conv_kernel_size=2), "conv_kernel_size 2 does not fit", "layers.0.attention_conv"),
        (lambda c: c.update(conv_group_size=0), "conv_group_size must be a positive integer", "conv_group_size"),
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor", "sample_from_anchor"),
    ],
)
def test_wrong_variants_are_refused_in_one_line(tiny_target, tmp_path, change, message, vllm_finds):
    out = export_head(dflash2_dir(tiny_target, tmp_path / "head"), "speculators", tmp_path / "out").path
    edit_config(out, change)
    found = check_directory(out, "speculators")
    assert any(vllm_finds in p for p in found["vllm"]), found["vllm"]
    with pytest.raises(SpecHeadsError, match=message) as err:
        load_exported(out, tiny_target)
    assert "\n" not in str(err.value)


def test_draft_length_and_engines(tiny_target, tmp_path):
    src = dflash2_dir(tiny_target, tmp_path / "head")
    with pytest.raises(SpecHeadsError, match="serve it with 4") as err:
        export_head(src, "speculators", tmp_path / "short", num_speculative_tokens=3)
    assert "\n" not in str(err.value)
    with pytest.raises(SpecHeadsError, match="without embeddings"):
        export_head(src, "speculators", tmp_path / "emb", embeddings=True)
    with pytest.raises(SpecHeadsError, match="format dflash holds dflash heads"):
        export_head(src, "dflash", tmp_path / "native")  # z-lab's format has no DFlash2 fields here
    # more taps than slots: vLLM (and our head) mask the taps before slot 0, speculators' model refuses them
    wide = dflash2_dir(tiny_target, tmp_path / "wide", block_size=3, conv_kernel_size=4)
    result = export_head(wide, "speculators", tmp_path / "wide_out")
    assert result.engines == ["vllm"] and not result.findings["vllm"]
    assert any("conv_kernel_size 4 must be at most block_size 3" in p for p in result.findings["speculators"])
    with pytest.raises(SpecHeadsError, match="refuses conv_kernel_size 4 > block_size 3"):
        export_head(wide, "speculators", tmp_path / "wide_spec", engine="speculators")


def test_model_card_serves_it_as_dflash(tiny_target, tmp_path):
    from specheads.export import HeadSource
    from specheads.export.model_card import serve_commands

    src = HeadSource.read(dflash2_dir(tiny_target, tmp_path / "head"))
    commands = dict(serve_commands(src, "speculators", ["vllm", "speculators"], "DRAFT", "TARGET"))
    assert '"method": "dflash"' in commands["vLLM"] and '"num_speculative_tokens": 4' in commands["vLLM"]
    assert "DFlash2DraftModel.from_pretrained('DRAFT')" in commands["speculators (Python)"]


# -- the engines' own code ----------------------------------------------------------------------------

SPECULATORS = r"""
import ast, importlib.util, json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
import speculators.models.dflash2.model_definitions as definitions
from speculators import SpeculatorModelConfig
from speculators.models.dflash2 import DFlash2SpeculatorConfig
from speculators.models.dflash2.core import DFlash2DraftModel

draft, inputs, anchor = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = DFlash2SpeculatorConfig.from_pretrained(draft)
layer = config.transformer_layer_config
report = {"config": {
    "class": type(SpeculatorModelConfig.from_pretrained(draft)).__name__,
    "speculators_model_type": config.speculators_model_type,
    "architectures": config.architectures,
    "speculative_tokens": config.speculators_config.proposal_methods[0].speculative_tokens,
    **{k: getattr(config, k) for k in (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "block_size", "mask_token_id",
        "aux_hidden_state_layer_ids", "sliding_window_non_causal", "sample_from_anchor", "draft_vocab_size",
        "target_hidden_size")},
    "layer": {k: getattr(layer, k) for k in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size")},
}}

layer._attn_implementation = "eager"  # the default flex attention compiles its block mask (GPUs)
model = DFlash2DraftModel.from_pretrained(draft, config=config).eval()  # then the verifier's embed/LM head
ckpt, state = load_file(draft + "/model.safetensors"), model.state_dict()
report["weights"] = {
    "unknown": sorted(set(ckpt) - set(state)),
    "changed": sorted(n for n in ckpt if n in state and not torch.equal(state[n], ckpt[n])),
    "not_ours": sorted(set(state) - set(ckpt)),
    "nan": sorted(n for n, t in state.items() if t.is_floating_point() and t.isnan().any()),
}

# one block: the only position loss_mask allows is the anchor select_anchors draws (speculators' anchor
# holds the bonus token; the context is every position before it)
x = load_file(inputs)
ids, aux = x["input_ids"], x["aux"]
t = ids.shape[1]
loss_mask = torch.zeros(1, t, dtype=torch.long)
loss_mask[0, anchor] = 1


def block():
    with torch.no_grad():
        h, unary, _, _, where = model._backbone_forward(
            aux, ids, loss_mask, torch.zeros(1, t, layer.hidden_size), torch.zeros(1, t, dtype=torch.long),
            max_anchors=1)
    return h[0], unary[0], where.tolist()


# vLLM's CPU fallbacks (qwen3_dflash2.py), defined from its source without importing vLLM
source = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "model_executor/models/qwen3_dflash2.py"
tree = ast.parse(source.read_text())
scope = {"torch": torch, "F": torch.nn.functional}
chosen = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_grouped_conv", "_score_edges")]
exec(compile(ast.Module(chosen, []), str(source), "exec"), scope)
selector, top_k, bonus = model.candidate_selector, config.selector_top_k, ids[0, anchor : anchor + 1]


def speculators_walk(h, unary):
    # speculators' CandidateSelector, each slot after the token drafted before it (the bonus token first)
    previous, out = int(bonus), []
    for k in range(1, len(h)):
        candidates, scores = selector.select(unary[k : k + 1], h[k : k + 1], torch.tensor([previous]))
        previous = int(candidates[0, scores[0].argmax()])
        out.append(previous)
    return out


def vllm_walk(h, unary):
    # vLLM's compute_candidates (unary top-k of the mask slots), _score_edges, and its selector kernel's
    # walk at temperature 0 (row `previous` of each slot's [k, k] scores, starting at the anchor's)
    with torch.no_grad():
        values, candidates = unary[1:].topk(top_k, dim=-1)
        scores = scope["_score_edges"](selector.predecessor_codebook, selector.successor_codebook, candidates[None],
                                       values[None], selector.hidden_projection(h[1:])[None], bonus, top_k)[0]
    index, out = 0, []
    for k in range(len(candidates)):
        index = int(scores[k, index].argmax())
        out.append(int(candidates[k, index]))
    return out


h, unary, where = block()
report["block_positions"] = where


def vllm_conv(hidden_states, delta_kernel, base_kernel, *, block_size, group_size):
    # vLLM's _grouped_conv on its rows (slot = row % block_size) in place of speculators' convolution
    taps, size = base_kernel.shape
    rows = hidden_states.reshape(-1, size)
    out = scope["_grouped_conv"](rows, delta_kernel.reshape(len(rows), taps, size // group_size), base_kernel,
                                 block_size, size // group_size, group_size, taps)
    return out.reshape(hidden_states.shape)


definitions.grouped_dynamic_conv = vllm_conv
h2, unary2, _ = block()
report["drafts"] = {
    "speculators": speculators_walk(h, unary),
    "vllm_selector": vllm_walk(h, unary),
    "vllm_conv_and_selector": vllm_walk(h2, unary2),
    "unary_argmax": unary[1:].argmax(-1).tolist(),
}
report["conv_gap"] = float((h2 - h).abs().max())
print(json.dumps(report))
"""

VLLM = r"""
import json, re, socket, sys, types
import torch
from safetensors.torch import load_file
from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention, dflash_has_any_non_causal
from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS
from vllm.transformers_utils.config import get_config
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.triton_utils import HAS_TRITON
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

draft, target = sys.argv[1], sys.argv[2]
cfg = get_config(draft, trust_remote_code=False)
raw = json.load(open(draft + "/config.json"))
serving = SpeculatorsConfig.extract_vllm_speculative_config(raw)
spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=cfg))
report = {"config": {
    "config": type(cfg).__name__,
    "architectures": cfg.architectures,
    "class": list(_SPECULATIVE_DECODING_MODELS[cfg.architectures[0]]),
    "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec)),
    "dflash_config": cfg.dflash_config,
    "non_causal": dflash_has_any_non_causal(cfg),
    "layers": [list(_resolve_layer_attention(cfg, i)) for i in range(cfg.num_hidden_layers)],
    "serving": serving,
}}

# the engine's config, as `vllm serve` builds it from the speculative config: what the CPU build refuses
target_config = ModelConfig(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256)
parallel = ParallelConfig()
speculative = SpeculativeConfig(model=draft, **serving, target_model_config=target_config,
                                target_parallel_config=parallel)


def engine():
    return VllmConfig(model_config=target_config, speculative_config=speculative, parallel_config=parallel,
                      device_config=DeviceConfig("cpu"))


try:
    engine()
    refused = None
except ValueError as err:
    found = re.search(r"Value error, (.*?) \[type=", str(err))
    refused = found.group(1) if found else str(err).splitlines()[0]
report["cpu"] = {"has_triton": HAS_TRITON, "refused": refused}

# past the model-runner check, the model class itself builds on CPU: its parameters and weight loader
VllmConfig._validate_v1_model_runner = lambda self: None
vllm_config = engine()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(vllm_config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    model = DFlash2Qwen3ForCausalLM(vllm_config=vllm_config)
    params = dict(model.named_parameters())
    ckpt = load_file(draft + "/model.safetensors")

    def blank():
        for p in params.values():
            p.data.fill_(float("nan"))

    into = {}  # each tensor of ours, loaded alone: the parameters it writes, and whether it writes its values
    for name, tensor in ckpt.items():
        blank()
        model.load_weights([(name, tensor)])
        into[name] = []
        for n, p in params.items():
            written = p.data[~p.data.isnan()]
            if written.numel():
                into[name].append([n, written.numel() == tensor.numel() and torch.equal(written, tensor.flatten())])
    blank()
    model.load_weights(ckpt.items())
    layer = model.model.layers[0]
report["weights"] = {
    "params": {n: list(p.shape) for n, p in params.items()},
    "into": into,
    "unloaded": sorted(n for n, p in params.items() if p.isnan().any()),
    "conv": [layer.attention_conv.block_size, layer.attention_conv.taps, layer.attention_conv.group_size,
             layer.mlp_conv.block_size, model.model.candidate_selector.top_k],
}
print(json.dumps(report))
"""


def run_engine(script: str, *args) -> dict:
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engines(tiny_target, tmp_path_factory):
    """One export read by both engines (speculators with the tiny target as its verifier, for the
    embedding and LM head it takes from it), and what our head drafts."""
    if not VLLM_PYTHON.is_file():
        pytest.skip("vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
    root = tmp_path_factory.mktemp("dflash2_engines")
    tiny_target.model.save_pretrained(root / "verifier")  # config.json and weights: the target of both engines
    src = dflash2_dir(tiny_target, root / "head")
    out = export_head(src, "speculators", root / "out", base_model=str(root / "verifier")).path
    head = load_head(src, tiny_target)
    states = tiny_target.states(IDS, layer_ids=head.target_layer_ids(), final=False)
    aux = torch.cat([states.hidden[k] for k in head.spec.layer_ids], dim=-1)  # vLLM's aux order: ascending ids
    save_file({"input_ids": IDS.contiguous(), "aux": aux.contiguous()}, str(root / "inputs.safetensors"))
    return {
        "head": head,
        "out": out,
        "ours": drafts(head, tiny_target)[0],
        "speculators": run_engine(SPECULATORS, out, root / "inputs.safetensors", ANCHOR),
        "vllm": run_engine(VLLM, out, root / "verifier"),
    }


@pytest.mark.engines
@needs_engines
def test_speculators_config_class_reads_the_head(engines):
    spec = engines["head"].spec
    info = engines["head"].info
    assert engines["speculators"]["config"] == {
        "class": "DFlash2SpeculatorConfig",
        "speculators_model_type": "dflash2",
        "architectures": ["DFlash2DraftModel"],
        "speculative_tokens": spec.block_size - 1,
        **{k: getattr(spec, k) for k in FIELDS},
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "aux_hidden_state_layer_ids": spec.layer_ids,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "draft_vocab_size": info.vocab_size,
        "target_hidden_size": info.hidden_size,
        "layer": {
            "model_type": "qwen3",
            "hidden_size": info.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.dflash_layers,
            "num_attention_heads": info.num_attention_heads,
            "num_key_value_heads": info.num_key_value_heads,
            "head_dim": info.head_dim,
            "vocab_size": info.vocab_size,
        },
    }


@pytest.mark.engines
@needs_engines
def test_vllm_config_reader_serves_it_as_dflash2(engines):
    spec = engines["head"].spec
    assert spec.layer_ids == [2, 3, 4]
    assert engines["vllm"]["config"] == {
        "config": "SpeculatorsConfig",
        "architectures": ["DFlash2DraftModel"],
        "class": ["qwen3_dflash2", "DFlash2Qwen3ForCausalLM"],
        "aux_layer_ids": [2, 3, 4],  # the head's ids: vLLM captures target_layer_ids + 1
        "dflash_config": {
            "mask_token_id": 7,
            "target_layer_ids": [1, 2, 3],  # vLLM's aux ids - 1
            "sample_from_anchor": False,
            "causal": False,
            **{k: getattr(spec, k) for k in FIELDS},
        },
        "non_causal": True,
        "layers": [[None, False]] * 3,  # (sliding window, causal) per draft layer
        "serving": {"method": "dflash", "num_speculative_tokens": spec.block_size - 1},
    }


@pytest.mark.engines
@needs_engines
def test_vllm_model_takes_every_tensor_and_gets_every_parameter(engines):
    weights = engines["vllm"]["weights"]
    ours = load_file(str(engines["out"] / "model.safetensors"))
    into, params = weights["into"], weights["params"]
    # each tensor we write lands, whole and unchanged, in exactly one of vLLM's parameters
    assert sorted(into) == sorted(ours)
    assert {name: [ok for _, ok in hits] for name, hits in into.items()} == {name: [True] for name in ours}
    # and every parameter but the target's shared embedding and LM head (and the optional
    # mask_embedding.pt override) gets its values from them
    shared = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
    assert {hits[0][0] for hits in into.values()} == set(params) - shared
    assert weights["unloaded"] == sorted(shared)
    # DFlash2's own tensors under the names and shapes of the head's docstring (model. in front)
    own = [n for n in ours if "_conv." in n or n.startswith("candidate_selector.")]
    assert len(own) == 4 * 3 + 3
    assert {n: into[n][0][0] for n in own} == {n: f"model.{n}" for n in own}
    assert {n: params[f"model.{n}"] for n in own} == {n: list(ours[n].shape) for n in own}
    spec = engines["head"].spec
    # its convolutions' block is 1 + num_speculative_tokens: the trained block
    assert weights["conv"] == [spec.block_size, spec.conv_kernel_size, spec.conv_group_size, spec.block_size, 6]


@pytest.mark.engines
@needs_engines
def test_engines_draft_what_the_head_drafts_at_every_slot(engines):
    seen = engines["speculators"]
    assert seen["weights"] == {
        "unknown": [],
        "changed": [],
        "not_ours": ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"],
        "nan": [],
    }
    assert seen["block_positions"] == list(range(ANCHOR, ANCHOR + 5))  # slot 0 at the bonus token
    ours, theirs = engines["ours"], seen["drafts"]
    assert len(ours) == 4
    assert theirs["speculators"] == ours
    assert theirs["vllm_selector"] == ours
    assert theirs["vllm_conv_and_selector"] == ours and seen["conv_gap"] < 1e-5
    assert theirs["unary_argmax"] != ours  # the selector decides some slot: the check has power


@pytest.mark.engines
@needs_engines
def test_vllm_cpu_build_cannot_serve_it(engines):
    """vLLM's CPU build has no Triton, so it runs the V1 model runner, and DFlash2's selector walk
    lives in the V2 runner only (v1/worker/gpu/spec_decode/dflash2): its config refuses the draft."""
    assert engines["vllm"]["cpu"] == {
        "has_triton": False,
        "refused": "Model Runner V1 does not support: DFlash candidate-head drafts",
    }
