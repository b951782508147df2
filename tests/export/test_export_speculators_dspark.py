"""Format speculators for a DSpark head (speculators' `dspark` type): the round trip drafts the same
tokens and confidences, every DSpark field is written, the draft length is the trained block's, and
variants we do not train (or that vLLM cannot serve) are refused in one line.

Marker `engines` (vLLM's virtualenv, which `make engines` builds): speculators' own DSparkDraftModel
loads our export and drafts our tokens at every block slot (the slot convention: sglang#30852 was
trainers numbering slots one apart), its compute_metrics gives our confidence loss, its config class
reads every field, and vLLM's reader translates them as speculators_dspark.vllm_view says and loads
every tensor into its Qwen3DSparkModel (which its CPU build cannot run: the last test pins why)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import head_states
from safetensors.torch import save_file
from test_export import PROMPT, edit_config, edit_tensors, make_head_dir

from specheads.errors import SpecHeadsError
from specheads.export import HeadSource, check_directory, export_head, load_exported, open_head
from specheads.export.model_card import serve_commands
from specheads.export.speculators_dspark import speculative_tokens, vllm_view
from specheads.heads import load_head

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NO_VLLM = "vLLM's virtualenv .venv-vllm is absent (make engines builds it)"
SMALL = {"block_size": 4, "markov_rank": 8}
DSPARK_FIELDS = (
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "block_size",
    "mask_token_id",
    "draft_vocab_size",
)
VARIANTS = [
    {},
    {"sample_from_anchor": False, "markov_head_type": "gated", "dflash_layers": 3},
    {"enable_confidence_head": False, "confidence_head_with_markov": False, "mask_token_id": 7},
]


def dspark_head_dir(target, directory: Path, **overrides) -> Path:
    return make_head_dir(target, directory, "dspark", **{**SMALL, **overrides})


def chain_drafts(head, target, prompt=PROMPT, anchor=None):
    """The block after prompt[:, :anchor + 1] (its last token the bonus one), drafted as infer.py
    does: its top-1 chain, the chain's logits per depth and the confidence of each depth."""
    anchor = prompt.shape[1] - 2 if anchor is None else anchor
    s = target.states(prompt, layer_ids=head.target_layer_ids(), final=False)
    features = head.input_features(s.hidden)
    ids = prompt[:, 1 : anchor + 2]  # the token after each context position: the last, the bonus token
    with torch.no_grad():
        block = head.draft_block(ids, features[:, : anchor + 1], head.new_cache(), head.max_draft_depth(head.spec))
        root = int(prompt[0, anchor + 1])
        tokens, logits = block.chain(root)
        confidence = None
        if head.confidence_head is not None:
            confidence = block.confidence(list(range(1, len(tokens) + 1)), [root, *tokens[:-1]])
    return tokens, logits, confidence


def same_drafts(a, b) -> None:
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])
    assert (a[2] is None) == (b[2] is None) and (a[2] is None or torch.equal(a[2], b[2]))


@pytest.mark.parametrize("overrides", VARIANTS)
def test_round_trip_drafts_the_same_tokens(tiny_target, tmp_path, overrides):
    src = dspark_head_dir(tiny_target, tmp_path / "head", **overrides)
    original = load_head(src, tiny_target)
    spec = original.spec
    vllm = spec.markov_head_type == "vanilla"
    result = export_head(src, "speculators", tmp_path / "out")
    assert result.engines == (["vllm", "speculators"] if vllm else ["speculators"])
    assert result.findings["speculators"] == [] and (result.findings["vllm"] == []) == vllm
    config = json.loads((result.path / "config.json").read_text())
    assert "model_type" not in config
    assert config["architectures"] == ["DSparkSpeculator"] and config["speculators_model_type"] == "dspark"
    assert config["speculators_config"]["algorithm"] == "dspark"
    blocks = spec.block_size if spec.sample_from_anchor else spec.block_size - 1
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == blocks
    assert blocks == original.max_draft_depth(spec)  # what the head drafts
    for name in DSPARK_FIELDS:
        assert config[name] == getattr(spec, name), name
    assert config["aux_hidden_state_layer_ids"] == spec.layer_ids and config["target_hidden_size"] == 64
    assert config["transformer_layer_config"]["is_causal"] is False
    # what vLLM builds from it (algos.update_dspark, written out; the engines test holds it to vLLM's own)
    view = vllm_view(config)
    assert view["target_layer_ids"] == [k - 1 for k in spec.layer_ids]
    assert view["dspark_bonus_anchor"] is (not spec.sample_from_anchor)
    assert view["architectures"] == ["Qwen3DSparkModel"]
    exported = open_head(result.path, tiny_target)
    assert type(exported) is type(original)
    assert all(getattr(exported.spec, k) == getattr(spec, k) for k in (*DSPARK_FIELDS, "layer_ids", "dflash_layers"))
    before = chain_drafts(original, tiny_target)
    same_drafts(chain_drafts(exported, tiny_target), before)
    edit_config(result.path, lambda c: c.pop("specheads"))  # the engine fields alone give the same head
    same_drafts(chain_drafts(load_exported(result.path, tiny_target), tiny_target), before)


def test_draft_length_is_the_trained_block():
    assert speculative_tokens(8, True, None) == 8 and speculative_tokens(8, False, None) == 7
    assert speculative_tokens(8, True, 8) == 8
    for anchor, wrong in ((True, 7), (True, 9), (False, 8), (False, 3)):
        with pytest.raises(SpecHeadsError, match="vllm#41834") as caught:
            speculative_tokens(8, anchor, wrong)
        assert "\n" not in str(caught.value)


def drop(key):
    return lambda c: c.pop(key)


def tokens_to(n):
    return lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=n)


@pytest.mark.parametrize(
    "change, message",
    [
        (drop("sample_from_anchor"), "sample_from_anchor must be written"),
        (tokens_to(3), "speculative_tokens"),  # the block of 4 drafts 4 with sample_from_anchor
        (lambda c: c.update(markov_head_type="rnn"), "rnn"),
        (lambda c: c.update(markov_rank=0), "markov_rank"),
        (drop("mask_token_id"), "mask_token_id"),
    ],
)
def test_wrong_variants_are_refused(tiny_target, tmp_path, change, message):
    out = export_head(dspark_head_dir(tiny_target, tmp_path / "head"), "speculators", tmp_path / "out").path
    edit_config(out, change)
    found = check_directory(out, "speculators")
    assert any(message in p for p in found["vllm"]), found
    with pytest.raises(SpecHeadsError, match=message) as caught:
        load_exported(out, tiny_target)
    assert "\n" not in str(caught.value)


def test_weights_that_do_not_fit_are_refused(tiny_target, tmp_path):
    out = export_head(dspark_head_dir(tiny_target, tmp_path / "head"), "speculators", tmp_path / "out").path
    edit_config(out, lambda c: c.update(markov_rank=4))  # the tensors have rank 8
    found = check_directory(out, "speculators")
    assert any("markov_head.markov_w1.weight has shape" in p for p in found["speculators"]), found
    with pytest.raises(SpecHeadsError, match="does not fit"):
        load_exported(out, tiny_target)
    out = export_head(dspark_head_dir(tiny_target, tmp_path / "h2"), "speculators", tmp_path / "o2").path
    edit_tensors(out, "model.safetensors", lambda t: t.pop("confidence_head.proj.bias"))
    found = check_directory(out, "speculators")
    assert "missing tensor confidence_head.proj.bias" in found["vllm"] and found["speculators"]


def test_vllm_is_refused_a_gated_head_and_other_lengths(tiny_target, tmp_path):
    src = dspark_head_dir(tiny_target, tmp_path / "head", markov_head_type="gated")
    with pytest.raises(SpecHeadsError, match="vanilla Markov head only") as caught:
        export_head(src, "speculators", tmp_path / "out", engine="vllm")
    assert "\n" not in str(caught.value)
    assert export_head(src, "speculators", tmp_path / "out", engine="speculators").engines == ["speculators"]
    with pytest.raises(SpecHeadsError, match="serve it with 4"):
        export_head(src, "speculators", tmp_path / "short", num_speculative_tokens=3)
    with pytest.raises(SpecHeadsError, match="without embeddings"):
        export_head(src, "speculators", tmp_path / "emb", embeddings=True)


def test_model_card_serves_it_as_dspark(tiny_target, tmp_path):
    src = HeadSource.read(dspark_head_dir(tiny_target, tmp_path / "head"))
    commands = dict(serve_commands(src, "speculators", ["vllm", "speculators"], "DRAFT", "TARGET"))
    assert '"method": "dspark"' in commands["vLLM"] and '"num_speculative_tokens": 4' in commands["vLLM"]
    assert "speculators.models.dspark import DSparkDraftModel" in commands["speculators (Python)"]


# -- the engines' own code -------------------------------------------------------------------------------


def run_in_vllm(script: str, *args) -> dict:
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def verifier(tiny_target, tmp_path_factory) -> Path:
    """The tiny target as a Hugging Face directory: the verifier speculators loads the embedding,
    LM head and final norm from (load_verifier_weights), and the target vLLM's config reads."""
    path = tmp_path_factory.mktemp("verifier")
    tiny_target.model.save_pretrained(path)
    return path


def engine_export(target, tmp_path: Path, verifier: Path, **overrides) -> tuple[Path, object]:
    src = dspark_head_dir(target, tmp_path / "head", **overrides)
    out = export_head(src, "speculators", tmp_path / "out", base_model=str(verifier), engine="speculators").path
    return out, load_head(src, target)


SPECULATORS_FORWARD = """
import json, sys
import torch
from safetensors.torch import load_file
import speculators.models.dspark.core as core
from speculators.losses import resolve_loss_config
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

directory, case_file = sys.argv[1], sys.argv[2]
case = load_file(case_file)
config = DSparkSpeculatorConfig.from_pretrained(directory)
# speculators' eager attention (create_float_mask); its default flex attention gives the same on CPU, slower
config.transformer_layer_config._attn_implementation = "eager"
model = DSparkDraftModel.from_pretrained(directory, config=config).eval()  # loads the verifier's embedding and LM head
seen, real = {}, core.compute_metrics
def capture(logits, targets, confidence_logits, *args, **kwargs):
    seen["logits"], seen["confidence"] = logits.detach(), confidence_logits
    return real(logits, targets, confidence_logits, *args, **kwargs)
core.compute_metrics = capture
prompt, hidden = case["prompt"], case["hidden"]
T = prompt.shape[1]
first = 0 if config.sample_from_anchor else 1  # slot 0 drafts only with sample_from_anchor
out = {}
for key in sorted(k for k in case if k.startswith("chain_")):
    t = int(key.split("_")[1])
    chain = case[key].tolist()
    p = t + 1  # speculators' anchor: the bonus token's position (ours, t, is the one before it)
    ids = prompt.clone()
    for j, token in enumerate(chain):  # the drafts before each slot, which its Markov bias reads
        if p + 1 + j < T:
            ids[0, p + 1 + j] = token
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, p] = 1  # the one anchor select_anchors can draw
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=ids, loss_mask=mask,
              verifier_last_hidden_states=torch.zeros(1, T, model.hidden_size),
              document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=1,
              loss_config=resolve_loss_config("kl_div", "eager"),
              tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0])
    logits = seen["logits"][0]
    ours = case[f"logits_{t}"]
    out[t] = {
        "argmax": logits[first:].argmax(-1).tolist(),
        "chain": chain,
        "logits_err": float((logits[first:] - ours).abs().max()),
        "shifted_err": float((logits[first + 1:] - ours[:-1]).abs().max()),  # slots one apart
    }
    if seen["confidence"] is not None:
        conf = torch.sigmoid(seen["confidence"][0, first:].float())
        out[t]["confidence_err"] = float((conf - case[f"conf_{t}"]).abs().max())
names = json.loads(sys.argv[3])
fields = {k: getattr(config, k) for k in names}
fields["speculative_tokens"] = config.speculators_config.proposal_methods[0].speculative_tokens
fields["verifier"] = config.speculators_config.verifier.name_or_path
print(json.dumps({"cases": out, "fields": fields, "class": type(model).__name__,
                  "markov": type(model.markov_head).__name__, "head_type": model.markov_head.head_type}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=NO_VLLM)
@pytest.mark.parametrize("overrides", VARIANTS)
def test_speculators_model_drafts_our_tokens_at_every_slot(tiny_target, tmp_path, verifier, overrides):
    """speculators' own DSparkDraftModel (from_pretrained on our export, its training forward on CPU)
    fed the same target states, anchor and drafts before each slot gives, at each drafting slot, the
    logits and confidence our head drafts at that depth: their slot k is our slot k. A numbering one
    apart would differ (shifted_err), and its config class reads every field as our head has it."""
    out, head = engine_export(tiny_target, tmp_path, verifier, **overrides)
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    s = tiny_target.states(prompt, layer_ids=head.target_layer_ids(), final=False)
    case = {"prompt": prompt, "hidden": torch.cat([s.hidden[k] for k in head.spec.layer_ids], dim=-1).contiguous()}
    for t in (4, 9, 14):  # our anchors: the last context position; speculators' is t + 1
        tokens, logits, confidence = chain_drafts(head, tiny_target, prompt, anchor=t)
        case[f"chain_{t}"], case[f"logits_{t}"] = torch.tensor(tokens), logits.contiguous()
        if confidence is not None:
            case[f"conf_{t}"] = confidence.contiguous()
    save_file(case, str(tmp_path / "case.safetensors"))
    names = [
        *DSPARK_FIELDS,
        "target_hidden_size",
        "aux_hidden_state_layer_ids",
        "speculators_model_type",
        "architectures",
    ]
    seen = run_in_vllm(SPECULATORS_FORWARD, out, tmp_path / "case.safetensors", json.dumps(names))
    spec = head.spec
    assert seen["class"] == "DSparkDraftModel" and seen["head_type"] == spec.markov_head_type
    for t, got in seen["cases"].items():
        assert got["argmax"] == got["chain"], t  # their per-slot argmax = our drafts, depth by depth
        assert len(got["chain"]) == head.max_draft_depth(spec)
        assert got["logits_err"] < 1e-4 and got["shifted_err"] > 1e-2, (t, got)
        assert ("confidence_err" in got) == spec.enable_confidence_head
        assert got.get("confidence_err", 0.0) < 1e-5, (t, got)
    assert seen["fields"] == {
        "sample_from_anchor": spec.sample_from_anchor,
        "markov_rank": spec.markov_rank,
        "markov_head_type": spec.markov_head_type,
        "enable_confidence_head": spec.enable_confidence_head,
        "confidence_head_with_markov": spec.confidence_head_with_markov,
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": tiny_target.info.hidden_size,
        "aux_hidden_state_layer_ids": spec.layer_ids,
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "speculative_tokens": head.max_draft_depth(spec),
        "verifier": str(verifier),
    }


SPECULATORS_METRICS = """
import json, sys
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config
from speculators.models.dspark.metrics import compute_metrics
t = load_file(sys.argv[1])
_, m = compute_metrics(t["logits"], t["targets"], t["confidence"], t["mask"], int(sys.argv[2]),
                       loss_config=resolve_loss_config("kl_div", "eager"),
                       tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0], gamma=float(sys.argv[3]),
                       confidence_head_alpha=1.0, sample_from_anchor=sys.argv[4] == "1")
print(json.dumps({k: float(v) for k, v in m.items() if k.startswith(("confidence", "accept_rate"))}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=NO_VLLM)
@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_confidence_loss_is_speculators_compute_metrics(tiny_target, sequences, tmp_path, sample_from_anchor):
    """Our confidence loss and error on a training step's blocks are what speculators' own
    compute_metrics (its accept_rate target, BCE, decay and reduction) gives on the same logits,
    target logits and confidence logits laid out as its blocks are."""
    src = dspark_head_dir(tiny_target, tmp_path / "head", sample_from_anchor=sample_from_anchor)
    head = load_head(src, tiny_target)
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    head.spec.anchors_per_sequence = 6
    states = head_states(tiny_target, head, batch)
    with torch.no_grad():
        torch.manual_seed(0)
        blocks = head.training_blocks(batch, states)
        ids = batch["input_ids"]
        prev = ids.gather(1, blocks.where - 1)
        logits = head.slot_logits(blocks.h, prev)  # every slot, block after block ([R, A x size, V])
        final = states["final"].gather(1, (blocks.where - 1)[..., None].expand(-1, -1, states["final"].shape[-1]))
        targets = head.target_logits(final)
        confidence = head.confidence_logits(blocks.h, prev)
        torch.manual_seed(0)
        _, ours = head.loss(batch, states)  # the same anchors
    n = logits.shape[0] * logits.shape[1]
    save_file(
        {
            "logits": logits.reshape(1, n, -1).contiguous(),
            "targets": targets.reshape(1, n, -1).contiguous(),
            "confidence": confidence.reshape(1, n).contiguous(),
            "mask": blocks.kept.reshape(1, n).float().contiguous(),
        },
        str(tmp_path / "t.safetensors"),
    )
    flag = "1" if sample_from_anchor else "0"
    seen = run_in_vllm(
        SPECULATORS_METRICS, tmp_path / "t.safetensors", head.spec.block_size, head.spec.dflash_gamma, flag
    )
    assert ours["confidence_loss"] == pytest.approx(seen["confidence_loss_sum"], rel=1e-5)
    error = seen["confidence_abs_error_sum"] / seen["confidence_abs_error_total"]
    assert ours["confidence_error"] == pytest.approx(error, rel=1e-5)
    assert 0 < seen["accept_rate_sum"] / seen["accept_rate_total"] < 1


VLLM_READ = """
import json, sys, tempfile, types
from safetensors.torch import load_file
from vllm.config import SpeculativeConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

directory, verifier = sys.argv[1], sys.argv[2]
raw = json.load(open(directory + "/config.json"))
cfg = SpeculatorsConfig.from_pretrained(directory)
serving = SpeculatorsConfig.extract_vllm_speculative_config(raw)
out = {"config": {k: v for k, v in cfg.to_dict().items() if k in json.loads(sys.argv[3])}, "serving": serving}
# the CPU build refuses a dspark engine (neither model runner drafts it): that line, then the
# speculative config and the draft model built alone, as the GPU runner builds them
try:
    EngineArgs(model=verifier, skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
               speculative_config={"model": directory, **serving}).create_engine_config()
    out["engine"] = "built"
except Exception as err:
    out["engine"] = str(err)
vc = EngineArgs(model=verifier, skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
                dtype="float32").create_engine_config()
sc = SpeculativeConfig(model=directory, num_speculative_tokens=serving["num_speculative_tokens"],
                       target_model_config=vc.model_config, target_parallel_config=vc.parallel_config)
vc.speculative_config = sc
hf = sc.draft_model_config.hf_config
out["speculative"] = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                      "architectures": sc.draft_model_config.architectures,
                      "aux_layer_ids": list(get_eagle3_aux_layers_from_config(sc))}
weights = load_file(directory + "/model.safetensors")
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="file://" + tempfile.mktemp(),
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=vc, prefix="")
    params = dict(model.named_parameters())
    try:
        model.load_weights(weights.items())
        out["load"] = "ok"
    except Exception as err:
        out["load"] = str(err).splitlines()[0]
# each vLLM parameter against the tensors written under its names (q/k/v and gate/up stacked)
import torch
def written(name):
    key = name.removeprefix("model.")
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in key:
            return torch.cat([weights[key.replace(fused, p)] for p in parts])
    return weights.get(key)
out["params"] = {}
for name, p in params.items():
    w = written(name)
    out["params"][name] = None if w is None else bool(w.shape == p.shape and torch.equal(w.to(p.dtype), p.data))
print(json.dumps(out))
"""
VLLM_FIELDS = [
    "architectures",
    "sample_from_anchor",
    "dspark_bonus_anchor",
    "eagle_aux_hidden_state_layer_ids",
    "target_layer_ids",
    "draft_vocab_size",
    "target_hidden_size",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "block_size",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "is_causal",
]


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=NO_VLLM)
@pytest.mark.parametrize("overrides", [VARIANTS[0], {"sample_from_anchor": False, "enable_confidence_head": False}])
def test_vllm_reads_it_as_dspark_and_loads_every_tensor(tiny_target, tmp_path, verifier, overrides):
    """vLLM's SpeculatorsConfig gives method dspark, the block's draft count and the translated fields
    (speculators_dspark.vllm_view, held to vLLM's own here); its Qwen3DSparkModel, built for the
    tiny target, loads every tensor we write and holds it in a parameter, and every parameter but
    the target's shared embedding / LM head and vLLM's unused mask placeholder comes from us."""
    out, head = engine_export(tiny_target, tmp_path, verifier, **overrides)
    spec = head.spec
    seen = run_in_vllm(VLLM_READ, out, verifier, json.dumps(VLLM_FIELDS))
    raw = json.loads((out / "config.json").read_text())
    ours = vllm_view(raw)
    assert seen["config"] == {k: ours[k] for k in VLLM_FIELDS if k in ours}
    assert set(seen["config"]) == set(VLLM_FIELDS)
    assert seen["config"]["target_layer_ids"] == [k - 1 for k in spec.layer_ids]  # vLLM's aux - 1
    assert seen["config"]["dspark_bonus_anchor"] is (not spec.sample_from_anchor)
    tokens = head.max_draft_depth(spec)
    assert seen["serving"] == {"method": "dspark", "num_speculative_tokens": tokens}
    assert seen["speculative"] == {
        "method": "dspark",
        "num_speculative_tokens": tokens,
        "architectures": ["Qwen3DSparkModel"],
        "aux_layer_ids": spec.layer_ids,  # what the target captures: our ids
    }
    assert seen["load"] == "ok"
    shared = {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}
    assert {n for n, same in seen["params"].items() if same is None} == shared
    assert all(same for n, same in seen["params"].items() if n not in shared), seen["params"]
    confidence = {n for n in seen["params"] if n.startswith("model.confidence_head.")}
    assert confidence == (
        {"model.confidence_head.proj.weight", "model.confidence_head.proj.bias"}
        if spec.enable_confidence_head
        else set()
    )
    assert "Model Runner V1 does not support: dspark" in seen["engine"]


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=NO_VLLM)
def test_vllm_refuses_the_gated_heads_weights(tiny_target, tmp_path, verifier):
    """The contract's refusal of a gated head for vLLM is vLLM's own: its loader refuses gate_proj."""
    out, _ = engine_export(tiny_target, tmp_path, verifier, markov_head_type="gated")
    seen = run_in_vllm(VLLM_READ, out, verifier, json.dumps(VLLM_FIELDS))
    # its MLP stacking renames gate_proj to gate_up_proj, which DSparkMarkovHead does not have either
    assert "no module or parameter named 'markov_head.gate_up_proj'" in seen["load"], seen["load"]
    assert any("vanilla" in p for p in check_directory(out, "speculators")["vllm"])
