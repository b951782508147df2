"""Export round trips: head -> engine format -> our loader gives the same drafts, for every format
and head family it applies to; the CLI; what export refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specheads.config.train import HeadConfig, ModelConfig
from specheads.errors import SpecHeadsError
from specheads.export import check_directory, export_head, load_exported, open_head, source_head_config
from specheads.heads import build_head, load_head, save_head
from specheads.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"input_ids": list(range(40, 200)), "loss_mask": [1] * 160}]
EAGLE3 = dict(layer_ids=[1, 3, 5], draft_vocab_size=96)
NORMS_ON = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)


# -- helpers (also used by the other test_export_* files) -----------------------------------------


def make_head_dir(target, directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A head with every weight nudged off its initialisation (zero-initialised ResBlocks too)."""
    torch.manual_seed(seed)
    head = build_head(HeadConfig(family=family, **{"num_heads": 3, **overrides}), target, train_rows=ROWS)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.default_tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    save_head(head, directory, training={"steps": 7, "data": "toy"})
    return directory


def draft_outputs(head, target, input_ids: torch.Tensor) -> torch.Tensor:
    """What the head drafts from a prompt: Medusa logits, or two chained EAGLE draft steps."""
    s = target.states(input_ids, layer_ids=head.target_layer_ids(), final=True)
    if head.family == "medusa":
        return head.medusa_logits(s.final)
    states = {**s.hidden, "final": s.final}
    if head.family == "peagle":  # every position in one forward
        return head.parallel_logits(input_ids, head.input_features(states), head.new_cache(), head.spec.parallel_depths)
    cache = head.new_cache()
    pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
    hidden, logits = head.draft_step(input_ids, head.input_features(states), pos, cache)
    nxt = head.draft_to_target(logits[:, -1:].argmax(-1))
    _, logits2 = head.draft_step(nxt, hidden[:, -1:], pos[:, -1:] + 1, cache)
    return torch.cat([logits, logits2], dim=1)


def edit_config(directory: Path, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def edit_tensors(directory: Path, filename: str, change) -> None:
    tensors = load_file(str(directory / filename))
    change(tensors)
    save_file(tensors, str(directory / filename))


PROMPT = torch.tensor([[258, 5, 77, 140, 33, 201, 12, 90, 64, 3, 111, 250]])

# (family, head overrides, format, engine)
ROUND_TRIPS = [
    ("medusa", {}, "vllm-medusa", "auto"),
    ("medusa", {}, "medusa", "auto"),
    ("medusa", {"shared_lm_head": True, "num_layers": 2}, "vllm-medusa", "auto"),
    ("medusa", {"shared_lm_head": True, "num_layers": 2}, "medusa", "auto"),
    ("eagle", {"fc_bias": False, "num_decoder_layers": 2}, "eagle", "auto"),
    ("eagle", {"fc_bias": True}, "eagle", "sglang"),
    ("eagle3", EAGLE3, "eagle3", "vllm"),
    ("eagle3", EAGLE3, "eagle3", "sglang"),
    ("eagle3", EAGLE3, "speculators", "auto"),
    ("eagle3", {"layer_ids": [1, 3, 5], "draft_vocab_size": 320, "num_decoder_layers": 2}, "speculators", "auto"),
    ("eagle3", {"layer_ids": [1, 3, 5], "draft_vocab_size": 320, "num_decoder_layers": 2}, "eagle3", "vllm"),
    ("peagle", EAGLE3, "eagle3", "auto"),
    ("peagle", {**EAGLE3, "train_embeddings": True, "num_decoder_layers": 2}, "eagle3", "vllm"),
    ("peagle", EAGLE3, "speculators", "auto"),
    ("peagle", {**EAGLE3, "train_embeddings": True}, "speculators", "auto"),
    # speculators' variants (its trainer's defaults), for vLLM in both of its formats
    ("eagle3", {**EAGLE3, **NORMS_ON}, "eagle3", "vllm"),
    ("peagle", {**EAGLE3, **NORMS_ON}, "speculators", "auto"),
]


@pytest.mark.parametrize(
    "family,overrides,fmt,engine",
    ROUND_TRIPS,
    ids=[f"{f}-{fmt}-{e}-{i}" for i, (f, _, fmt, e) in enumerate(ROUND_TRIPS)],
)
def test_round_trip_gives_identical_drafts(tiny_target, tmp_path, family, overrides, fmt, engine):
    src = make_head_dir(tiny_target, tmp_path / "head", family, **overrides)
    result = export_head(src, fmt, tmp_path / "out", engine=engine, target=tiny_target)
    assert result.findings and all(not result.findings[e] for e in result.engines)
    original = load_head(src, tiny_target)
    exported = open_head(result.path, tiny_target)  # dispatches to the engine-format reader
    assert source_head_config(result.path)["target"]["name"] == "tiny-random"
    assert type(exported) is type(original)
    assert exported.target_layer_ids() == original.target_layer_ids()
    assert exported.default_tree == original.default_tree
    assert torch.equal(draft_outputs(exported, tiny_target, PROMPT), draft_outputs(original, tiny_target, PROMPT))


@pytest.mark.parametrize(
    "fmt,engine,overrides",
    [
        ("eagle3", "vllm", EAGLE3),
        ("eagle3", "sglang", EAGLE3),
        ("speculators", "auto", EAGLE3),
        ("vllm-medusa", "auto", {"shared_lm_head": True}),
        ("medusa", "auto", {}),
        ("eagle", "auto", {}),
        ("eagle3", "auto", {**EAGLE3, "family": "peagle", "mask_token_id": 7}),
        ("speculators", "auto", {**EAGLE3, "family": "peagle", "train_embeddings": True}),
    ],
)
def test_engine_fields_alone_are_enough(tiny_target, tmp_path, fmt, engine, overrides):
    """A checkpoint someone else wrote has no provenance block: the engine fields must carry
    everything (layer numbering, norms, vocab maps, shared LM head, a P-EAGLE mask)."""
    overrides = dict(overrides)
    family = overrides.pop("family", None) or {"eagle3": "eagle3", "speculators": "eagle3", "eagle": "eagle"}.get(
        fmt, "medusa"
    )
    src = make_head_dir(tiny_target, tmp_path / "head", family, **overrides)
    out = export_head(src, fmt, tmp_path / "out", engine=engine, target=tiny_target).path
    edit_config(out, lambda c: c.pop("specheads"))
    assert source_head_config(out) is None
    original, exported = load_head(src, tiny_target), load_exported(out, tiny_target)
    assert exported.target_layer_ids() == original.target_layer_ids()
    if family == "medusa":
        assert exported.spec.shared_lm_head == original.spec.shared_lm_head
    if family == "peagle":
        assert (exported.family, exported.spec.mask_token_id) == ("peagle", original.spec.mask_token_id)
        assert exported.spec.train_embeddings == original.spec.train_embeddings
    assert torch.equal(draft_outputs(exported, tiny_target, PROMPT), draft_outputs(original, tiny_target, PROMPT))


def test_default_layer_ids_are_left_to_both_engines(tmp_path):
    """A head on [2, L//2, L-3] is written without explicit ids: vLLM and SGLang agree on the default."""
    target = load_target(
        ModelConfig(name="tiny-8", path="tiny:llama", tiny={"num_hidden_layers": 8}), device=torch.device("cpu")
    )
    src = make_head_dir(target, tmp_path / "head", "eagle3", draft_vocab_size=128)
    result = export_head(src, "eagle3", tmp_path / "out")
    config = json.loads((result.path / "config.json").read_text())
    assert sorted(result.engines) == ["sglang", "vllm"]
    assert "eagle_aux_hidden_state_layer_ids" not in config
    assert "eagle_aux_hidden_state_layer_ids" not in config["eagle_config"]
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    edit_config(result.path, lambda c: c.pop("specheads"))
    assert load_exported(result.path, target).target_layer_ids() == [2, 4, 5]


def test_layer_numbering_per_engine(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3)
    vllm = json.loads((export_head(src, "eagle3", tmp_path / "v", engine="vllm").path / "config.json").read_text())
    sglang = json.loads((export_head(src, "eagle3", tmp_path / "s", engine="sglang").path / "config.json").read_text())
    spec = json.loads((export_head(src, "speculators", tmp_path / "p").path / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # entering layer k
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # output of layer k
    assert "eagle_aux_hidden_state_layer_ids" not in sglang
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert spec["norm_before_residual"] is False and vllm["norm_before_residual"] is False


def test_file_layouts_match_the_engines(tiny_target, tmp_path):
    e3 = export_head(
        make_head_dir(tiny_target, tmp_path / "e3", "eagle3", **EAGLE3), "eagle3", tmp_path / "o3", engine="vllm"
    ).path
    keys = set(safe_open(str(e3 / "model.safetensors"), "pt").keys())
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= keys
    assert not any(k.startswith("layers.") for k in keys)
    cfg = json.loads((e3 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    assert cfg["rope_theta"] == 10000.0 and "rope_scaling" in cfg

    med = export_head(make_head_dir(tiny_target, tmp_path / "m", "medusa"), "medusa", tmp_path / "om").path
    mcfg = json.loads((med / "config.json").read_text())
    assert (mcfg["medusa_num_heads"], mcfg["medusa_num_layers"]) == (3, 1)
    mkeys = set(safe_open(str(med / "medusa_lm_head.safetensors"), "pt").keys())
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "2.1.weight"} <= mkeys

    vm = export_head(tmp_path / "m", "vllm-medusa", tmp_path / "ov").path
    vcfg = json.loads((vm / "config.json").read_text())
    assert vcfg["medusa_fc_bias"] is True and vcfg["model_type"] == "medusa"
    assert "blocks.2.layers.0.bias" in set(safe_open(str(vm / "model.safetensors"), "pt").keys())


def test_bfloat16_export(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3)
    out = export_head(src, "speculators", tmp_path / "out", dtype="bfloat16", embeddings=True, target=tiny_target).path
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
        assert f.get_slice("d2t").get_dtype() == "I64"
        assert f.get_slice("embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    original = load_file(str(src / "model.safetensors"))["fc.weight"]
    back = load_exported(out, tiny_target)
    assert torch.equal(back.fc.weight, original.to(torch.bfloat16).float())


# -- what export refuses ------------------------------------------------------------------------------


def test_refusals(tiny_target, tmp_path):
    medusa = make_head_dir(tiny_target, tmp_path / "m", "medusa")
    with pytest.raises(SpecHeadsError, match="holds eagle3/peagle heads"):
        export_head(medusa, "eagle3", tmp_path / "x")
    parallel = make_head_dir(tiny_target, tmp_path / "p", "peagle", **EAGLE3)
    with pytest.raises(SpecHeadsError, match="SGLang has no parallel drafting"):
        export_head(parallel, "eagle3", tmp_path / "x", engine="sglang")
    with pytest.raises(SpecHeadsError, match="export it without embeddings=true"):
        export_head(parallel, "eagle3", tmp_path / "x", embeddings=True, target=tiny_target)
    two_layers = make_head_dir(tiny_target, tmp_path / "two", "eagle3", layer_ids=[2, 3], draft_vocab_size=96)
    with pytest.raises(SpecHeadsError, match="exactly 3 target layers"):
        export_head(two_layers, "eagle3", tmp_path / "x", engine="vllm")
    e3 = make_head_dir(tiny_target, tmp_path / "e3", "eagle3", **EAGLE3)
    with pytest.raises(SpecHeadsError, match="choose engine=vllm or engine=sglang"):
        export_head(e3, "eagle3", tmp_path / "x")
    biased = make_head_dir(tiny_target, tmp_path / "b", "eagle", fc_bias=True)
    with pytest.raises(SpecHeadsError, match="cannot be exported for vllm"):
        export_head(biased, "eagle", tmp_path / "x", engine="vllm", target=tiny_target)
    with pytest.raises(SpecHeadsError, match="needs the target's LM head"):
        export_head(make_head_dir(tiny_target, tmp_path / "s", "medusa", shared_lm_head=True), "medusa", tmp_path / "x")
    with pytest.raises(SpecHeadsError, match="unknown export format"):
        export_head(medusa, "onnx", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_failed_contract_leaves_nothing_behind(tiny_target, tmp_path, monkeypatch):
    from specheads.export import vllm_medusa

    src = make_head_dir(tiny_target, tmp_path / "m", "medusa")
    good = export_head(src, "vllm-medusa", tmp_path / "out").path
    before = (good / "model.safetensors").read_bytes()
    build = vllm_medusa.build

    def drop_bias_flag(*args):
        exported = build(*args)
        exported.config["medusa_fc_bias"] = False  # the classic trap: vLLM would drop the biases
        return exported

    monkeypatch.setattr(vllm_medusa, "build", drop_bias_flag)
    with pytest.raises(SpecHeadsError, match="incomplete vllm-medusa export.*medusa_fc_bias"):
        export_head(src, "vllm-medusa", tmp_path / "out")
    assert (good / "model.safetensors").read_bytes() == before  # the previous export is untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_refuses_to_replace_a_foreign_directory(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "m", "medusa")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("keep me")
    with pytest.raises(SpecHeadsError, match="refusing to replace"):
        export_head(src, "medusa", tmp_path / "docs")
    assert (tmp_path / "docs" / "notes.txt").read_text() == "keep me"


def test_loader_rejects_a_head_for_another_target(tiny_target, tmp_path):
    out = export_head(
        make_head_dir(tiny_target, tmp_path / "h", "eagle3", **EAGLE3), "speculators", tmp_path / "o"
    ).path
    wide = load_target(
        ModelConfig(name="wide", path="tiny:llama", tiny={"hidden_size": 96}), device=torch.device("cpu")
    )
    with pytest.raises(SpecHeadsError, match="hidden size 64.*96"):
        load_exported(out, wide)


# -- the command line ----------------------------------------------------------------------------------


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "specheads.export", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_exports_and_rejects_a_typo_in_one_line(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "medusa", shared_lm_head=True)
    commands = [  # side by side (the typo is refused while composing)
        (f"head={src}", "format=medusa", f"out={tmp_path / 'out'}", "model=tiny-random"),
        (f"head={src}", "format=medusa", "outt=x"),
    ]
    with ThreadPoolExecutor(2) as pool:
        ok, typo = pool.map(lambda args: run_cli(*args, cwd=tmp_path), commands)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1] == str(tmp_path / "out")
    assert "trtllm: ok" in ok.stdout and "tgi: ok" in ok.stdout
    assert check_directory(tmp_path / "out", "medusa") == {"trtllm": [], "tgi": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head", "out"]  # no Hydra outputs or logs
    assert typo.returncode == 2 and typo.stderr.strip().count("\n") == 0, typo.stderr
    assert "outt" in typo.stderr


def test_no_format_serves_hydra_heads(tiny_target, tmp_path):
    """Every format refuses a Hydra head in one line that says why (no engine loads Hydra heads)."""
    src = make_head_dir(tiny_target, tmp_path / "head", "hydra")
    for fmt in ("eagle3", "speculators", "eagle", "vllm-medusa", "medusa"):
        with pytest.raises(SpecHeadsError, match="no serving-engine format serves Hydra heads"):
            export_head(src, fmt, tmp_path / "x")
    proc = run_cli(f"head={src}", "format=medusa", f"out={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "no serving-engine format serves Hydra heads" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "out").exists()


def compose_export(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specheads.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            return compose("export", overrides)
    finally:
        GlobalHydra.instance().clear()


def test_export_job_checks_its_input(tiny_target, tmp_path, capsys):
    from specheads.export.job import run_export

    src = make_head_dir(tiny_target, tmp_path / "head", "eagle", fc_bias=False)
    with pytest.raises(SpecHeadsError, match="does not hold eagle heads.*use one of eagle"):
        run_export(compose_export([f"head_path={src}", "format=vllm-medusa", f"out={tmp_path / 'x'}"]))
    with pytest.raises(SpecHeadsError, match="out=DIR is required"):
        run_export(compose_export([f"head_path={src}", "format=eagle"]))
    with pytest.raises(SpecHeadsError, match="push_to_hub=true needs repo_id"):
        run_export(compose_export([f"head_path={src}", "format=eagle", "push_to_hub=true"]))
    with pytest.raises(SpecHeadsError, match="does not exist"):
        run_export(compose_export([f"head_path={tmp_path / 'nope'}", "format=eagle", f"out={tmp_path / 'x'}"]))
    # the target is found through the head's own target name (conf/model/tiny-random.yaml)
    result = run_export(
        compose_export([f"head_path={src}", "format=eagle", f"out={tmp_path / 'out'}", "dtype=bfloat16"])
    )
    assert sorted(result.engines) == ["sglang", "vllm"]
    assert "embed_tokens.weight" in safe_open(str(tmp_path / "out" / "model.safetensors"), "pt").keys()
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "out")
    assert not (tmp_path / "x").exists()


def test_model_card_serves_peagle_with_parallel_drafting(tiny_target, tmp_path):
    """A P-EAGLE export is an EAGLE-3 checkpoint: without parallel_drafting vLLM would draft it one
    token per forward from positions it never trained as sequential steps."""
    from specheads.export import HeadSource
    from specheads.export.model_card import serve_commands

    for family, parallel in (("peagle", True), ("eagle3", False)):
        src = HeadSource.read(make_head_dir(tiny_target, tmp_path / family, family))
        vllm = dict(serve_commands(src, "eagle3", ["vllm"], "DRAFT", "TARGET"))["vLLM"]
        assert '"method": "eagle3"' in vllm and ('"parallel_drafting": true' in vllm) == parallel


def test_a_chain_longer_than_a_peagle_head_drafts_is_refused(tiny_target, tmp_path):
    """vLLM drafts num_speculative_tokens positions in one P-EAGLE forward: past the head's
    parallel_depths it would draft positions never trained. Refused in one line, nothing written;
    by default the export and its serve command name exactly parallel_depths."""
    parallel = make_head_dir(tiny_target, tmp_path / "p", "peagle", parallel_depths=2, **EAGLE3)
    for k in (3, 0):
        with pytest.raises(SpecHeadsError, match=rf"num_speculative_tokens={k}: this peagle head drafts 1..2 tokens"):
            export_head(parallel, "speculators", tmp_path / "x", num_speculative_tokens=k)
        assert not (tmp_path / "x").exists()
    export_head(parallel, "speculators", tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    from specheads.export.common import HeadSource
    from specheads.export.model_card import serve_commands

    commands = serve_commands(HeadSource.read(parallel), "speculators", ["vllm"], "DRAFT", "TARGET")
    assert '"num_speculative_tokens": 2' in commands[-1][1]
    export_head(parallel, "speculators", tmp_path / "one", num_speculative_tokens=1)


def test_export_for_a_target_that_renders_otherwise_says_so(tiny_target, tmp_path, capsys):
    """The export's target (model=, else the conf/model option of the head's target) renders chats
    otherwise than the head was trained on (config.json training.chat): one line; the same
    rendering, and a head without the record, say nothing."""
    from specheads.chat_template import chat_record, set_thinking
    from specheads.config.export import ExportJobConfig
    from specheads.export.job import run_export
    from specheads.tiny import byte_tokenizer

    made = byte_tokenizer("thinking")
    set_thinking(made, False)
    src = make_head_dir(tiny_target, tmp_path / "head", "eagle3", **EAGLE3)
    edit_config(src, lambda c: c["training"].update(chat=chat_record(made)))

    def export(name, **model):
        thinking = ModelConfig(name="tiny-random", path="tiny:llama", tiny={"template": "thinking"}, **model)
        capsys.readouterr()
        out = str(tmp_path / name)
        run_export(ExportJobConfig(head_path=str(src), format="eagle3", out=out, engine="vllm", model=thinking))
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]

    [line] = export("on", thinking=True)
    assert f"head {src} was trained on" in line and "thinking off" in line and "set model.thinking=false" in line
    assert export("off", thinking=False) == []
    edit_config(src, lambda c: c["training"].pop("chat"))
    assert export("old", thinking=True) == []
