"""The memory plan: head counts equal the built heads', ZeRO arithmetic, the four verdicts, and
train.py dry_run=true answering from the config alone (no weights, no network)."""

import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specheads.config import register_configs, typed
from specheads.config.model import ModelConfig
from specheads.config.train import HeadConfig
from specheads.errors import SpecHeadsError
from specheads.heads import build_head
from specheads.train.arch import from_arch_config, read_arch
from specheads.train.plan import (
    GB,
    Gpus,
    check_fits,
    dry_run,
    format_plan,
    head_parameters,
    head_state,
    layer_activations,
    make_plan,
    parse_memory,
)

ROOT = Path(__file__).resolve().parents[2]
# published parameter counts of the conf/model targets (their model cards)
PUBLISHED = {
    "llama-70b": 70.6e9,
    "llama-3.1-8b": 8.03e9,
    "qwen2.5-7b": 7.62e9,
    "qwen3-8b": 8.19e9,
    "mistral-7b": 7.25e9,
    "vicuna-7b": 6.74e9,
    "smollm2-135m": 134.5e6,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-1.7b": 1.72e9,
}


def job(*overrides):
    """train.py's typed config for these overrides, composed as train.py composes it."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            return typed(compose("config", list(overrides)))
    finally:
        GlobalHydra.instance().clear()


def gpus(count, memory):
    return Gpus(count, parse_memory(memory), "declared")


@pytest.mark.parametrize(
    "head_cfg",
    [
        HeadConfig(family="medusa"),
        HeadConfig(family="medusa", num_heads=3, num_layers=2, shared_lm_head=True),
        HeadConfig(family="eagle"),
        HeadConfig(family="eagle", num_decoder_layers=2, fc_bias=True, intermediate_size=96),
        HeadConfig(family="eagle3", draft_vocab_size=200),
        HeadConfig(family="eagle3", draft_vocab_size=200, num_decoder_layers=2, layer_ids=[1, 3], fc_bias=True),
        HeadConfig(family="eagle3", draft_vocab_size=100000),  # clipped to the target's vocab
        HeadConfig(family="hydra"),
        HeadConfig(family="hydra", num_heads=3, num_layers=2, shared_lm_head=True, hydra_prefix_layer=True),
        HeadConfig(family="dflash"),
        HeadConfig(family="dflash", dflash_layers=3, block_size=4, intermediate_size=96),
        HeadConfig(family="dspark"),
        HeadConfig(family="dspark", markov_rank=16, markov_head_type="gated", confidence_head_with_markov=False),
        HeadConfig(family="dspark", enable_confidence_head=False),
    ],
    ids=lambda c: f"{c.family}-{c.num_decoder_layers}-{c.num_layers}-{c.shared_lm_head}-{c.draft_vocab_size}",
)
def test_head_parameters_equal_the_built_heads(tiny_target, head_cfg):
    rows = [{"input_ids": list(range(320)), "loss_mask": [1] * 320}]
    head = build_head(head_cfg, tiny_target, train_rows=rows)
    assert head_parameters(head.spec, tiny_target.info) == sum(p.numel() for p in head.parameters())


def test_medusa2_plan_counts_its_lora_and_keeps_every_layer_for_the_backward():
    """The LoRA trains with the heads (its state is counted with theirs), the target's backward keeps
    every layer's activations, and no feature cache can feed it."""
    from specheads.target import load_target

    target = load_target(ModelConfig(name="tiny-random", path="tiny:llama"))  # a medusa2 head adapts it
    head = build_head(HeadConfig(family="medusa2"), target)
    trained = sum(p.numel() for p in head.parameters()) + sum(p.numel() for p in head.target_adapter().parameters())
    assert head_parameters(head.spec, target.info) == trained
    arch = read_arch(job("model=llama-3.1-8b").model)
    medusa, medusa2 = (
        make_plan(job("model=llama-3.1-8b", f"head={h}"), arch, gpus(1, "80GB")) for h in ("medusa", "medusa2")
    )
    assert medusa2.head_parameters > medusa.head_parameters
    info, n, wb = arch.info, medusa.batch * medusa.length, medusa.weight_bytes
    gained = medusa2.usage["replicated"].activations - medusa.usage["replicated"].activations
    # every layer instead of one, less the final state a medusa head reads from the state source
    layer = layer_activations(info, n, wb, info.hidden_size, info.intermediate_size)
    assert gained == pytest.approx((info.num_layers - 1) * layer - n * info.hidden_size * wb)
    assert medusa2.modes == ("replicated",) and "(c)" not in format_plan(medusa2)


def test_target_count_and_sizes_equal_the_tiny_target(tiny_target):
    arch = read_arch(ModelConfig(name="tiny-random", path="tiny:llama"))
    assert arch.num_parameters == sum(p.numel() for p in tiny_target.model.parameters())
    assert arch.info == tiny_target.info
    # conf/model/tiny-random.yaml carries the same numbers as specheads/tiny.py
    carried = from_arch_config("tiny-random", job("model=tiny-random").model.arch)
    assert carried.num_parameters == arch.num_parameters
    fields = ("hidden_size", "vocab_size", "num_layers", "intermediate_size", "num_attention_heads")
    fields += ("num_key_value_heads", "head_dim")
    assert all(getattr(carried.info, f) == getattr(arch.info, f) for f in fields)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_every_model_carries_its_published_size(model):
    cfg = job(f"model={model}")
    assert cfg.model.arch is not None
    arch = read_arch(cfg.model)
    assert arch.source == "model.arch"
    assert abs(arch.num_parameters - PUBLISHED[model]) / PUBLISHED[model] < 0.005


@pytest.mark.parametrize("weight_bytes,optimizer_bytes", [(2, 12), (4, 8)])
def test_zero_stages_shard_optimizer_then_gradients_then_parameters(weight_bytes, optimizer_bytes):
    n, world = 1_000_000, 8
    stage0 = head_state(n, 0, world, weight_bytes)
    assert stage0 == (n * weight_bytes, n * weight_bytes, n * optimizer_bytes)
    stage1, stage2, stage3 = (head_state(n, s, world, weight_bytes) for s in (1, 2, 3))
    assert stage1 == (stage0[0], stage0[1], stage0[2] / world)
    assert stage2 == (stage0[0], stage0[1] / world, stage0[2] / world)
    assert stage3 == tuple(b / world for b in stage0)
    assert head_state(n, 2, world, weight_bytes, offload_optimizer=True)[2] == 0
    with pytest.raises(SpecHeadsError, match="zero_stage"):
        head_state(n, 4, world, weight_bytes)


def test_zero3_plan_divides_the_head_state_by_the_world():
    arch = read_arch(job("model=llama-70b").model)
    # by key: the 70B recipe sets deepspeed.zero_stage, which a deepspeed= group choice does not override
    zero0 = make_plan(job("model=llama-70b", "head=eagle", "deepspeed.zero_stage=0"), arch, gpus(8, "80GB"))
    zero3 = make_plan(job("model=llama-70b", "head=eagle", "deepspeed.zero_stage=3"), arch, gpus(8, "80GB"))
    for part in ("params", "grads", "optimizer"):
        assert getattr(zero3.usage["replicated"], part) == pytest.approx(getattr(zero0.usage["replicated"], part) / 8)
    assert zero3.usage["replicated"].target == zero0.usage["replicated"].target  # the frozen target is not the head


def test_a_plan_that_fits_replicated():
    cfg = job("model=llama-3.1-8b", "head=eagle3")
    plan = make_plan(cfg, read_arch(cfg.model), gpus(1, "80GB"))
    assert plan.choice == "replicated"
    assert plan.usage["replicated"].target == pytest.approx(8.03e9 * 2, rel=0.01)
    assert plan.modes == ("replicated", "offline")  # nothing to shard over on one GPU
    text = format_plan(plan)
    assert text.splitlines()[-1].startswith("verdict: (a) online, the whole target on every rank")


def test_a_plan_that_needs_a_sharded_target():
    cfg = job("model=llama-70b", "head=eagle")
    plan = make_plan(cfg, read_arch(cfg.model), gpus(8, "80GB"))
    assert plan.choice == "sharded"
    replicated, sharded = plan.usage["replicated"], plan.usage["sharded"]
    assert replicated.target == pytest.approx(70.55e9 * 2, rel=0.001)
    assert sharded.target < replicated.target / 4 and sharded.total <= 0.9 * 80 * GB < replicated.total
    assert "train.py shards it (deepspeed.shard_target" in format_plan(plan).splitlines()[-1]


def test_a_plan_that_needs_offline_features_with_their_disk():
    cfg = job(
        "model=llama-70b", "head=eagle3", "data.max_examples=1000", "data.max_length=1024", "budget.conversations=null"
    )
    plan = make_plan(cfg, read_arch(cfg.model), gpus(2, "80GB"))
    assert plan.choice == "offline"
    assert not plan.fits("replicated") and not plan.fits("sharded")
    assert plan.tokens == 1000 * 1024 and "data.max_examples" in plan.tokens_note
    # written out: EAGLE-3 fuses a low, a middle and a high layer and trains on the final state
    # too, 4 states of Llama-3.3-70B's hidden size 8192, in bf16 (2 bytes)
    assert plan.disk == 1000 * 1024 * (3 + 1) * 8192 * 2
    last = format_plan(plan).splitlines()[-1]
    assert last.startswith("verdict: (c) offline features") and f"{plan.disk / GB:.1f} GB of disk" in last
    assumed = make_plan(job("model=llama-70b", "head=medusa"), plan.arch, gpus(2, "80GB"))  # no recipe
    assert assumed.tokens == 1_000_000 and "assumed" in format_plan(assumed)
    recipe = make_plan(job("model=llama-70b", "head=eagle3"), plan.arch, gpus(2, "80GB"))  # its data's size
    assert recipe.tokens == 268_000 * 1024 and "268,000 conversations x ~1,024 tokens" in recipe.tokens_note


def measured_feature_bytes_per_token(target, head_cfg: HeadConfig, tmp_path: Path) -> float:
    """Bytes a token takes on disk in a real bf16 feature cache of the states this head trains on,
    written by the cache writer train.py uses (the token ids and masks stored beside the states
    included)."""
    from specheads.data.features import write_features

    head = build_head(head_cfg, target)
    layer_ids, final = head.training_states()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 200, (n,), generator=g).tolist(), "loss_mask": [1] * n} for n in (300, 500)]
    out = tmp_path / f"features-{head_cfg.family}"
    index = write_features(target, rows, layer_ids, final, out, max_length=1024, dtype="bfloat16")
    return sum(f.stat().st_size for f in out.glob("*.safetensors")) / index["tokens"]


def planned_feature_bytes_per_token(family: str) -> float:
    cfg = job("model=tiny-random", f"head={family}", "plan.tokens=800")
    plan = make_plan(cfg, read_arch(cfg.model), gpus(1, "80GB"))
    return plan.disk / plan.tokens


# bytes a token takes beside its states: an int64 token id and an int8 loss-mask flag
ID_AND_MASK_BYTES = 8 + 1


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3"])
def test_the_planned_feature_disk_is_what_a_real_cache_takes(tiny_target, tmp_path, family):
    measured = measured_feature_bytes_per_token(tiny_target, HeadConfig(family=family), tmp_path)
    planned = planned_feature_bytes_per_token(family)
    # the plan counts the states; the cache adds ids, masks and a few hundred bytes of headers
    assert planned + ID_AND_MASK_BYTES <= measured <= (planned + ID_AND_MASK_BYTES) * 1.03


@pytest.mark.parametrize(
    "name, broken",
    [
        ("FEATURE_BYTES", 4),  # fp32 features
        ("state_count", lambda spec, info: 1),  # the layers a head fuses left out
    ],
)
def test_the_feature_disk_check_fails_on_a_broken_plan(monkeypatch, tiny_target, tmp_path, name, broken):
    """The check can fail: a plan that counts another dtype or another number of states is caught."""
    import specheads.train.plan as plan_module

    measured = measured_feature_bytes_per_token(tiny_target, HeadConfig(family="eagle3"), tmp_path)
    monkeypatch.setattr(plan_module, name, broken)
    planned = planned_feature_bytes_per_token("eagle3")
    assert not planned + ID_AND_MASK_BYTES <= measured <= (planned + ID_AND_MASK_BYTES) * 1.03


def test_a_plan_that_nothing_fits_is_refused_with_its_numbers():
    cfg = job("model=llama-70b", "head=medusa")
    plan = make_plan(cfg, read_arch(cfg.model), gpus(2, "40GB"))
    assert plan.choice is None
    last = format_plan(plan).splitlines()[-1]
    assert last.startswith("verdict: (d) refused: nothing fits 36.0 GB usable per rank")
    assert all(f"{plan.usage[m].total / GB:.1f}" in last for m in plan.modes)


def test_the_table_shows_every_part_per_rank_in_gb():
    cfg = job("model=llama-70b", "head=eagle")
    text = format_plan(make_plan(cfg, read_arch(cfg.model), gpus(8, "80GB")))
    table = {line.split("  ")[0]: line.split()[-3:] for line in text.splitlines() if "  " in line}
    for row in ("head parameters", "head gradients", "optimizer (AdamW)", "activations (estimate)", "total"):
        assert row in table and all(cell.count(".") == 1 and len(cell.split(".")[1]) == 1 for cell in table[row])
    assert table["fits"] == ["no", "yes", "yes"]


def test_gpu_memory_sizes():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("40.5 gb") == int(40.5e9)
    with pytest.raises(SpecHeadsError, match="80GB"):
        parse_memory("80")


def test_a_local_directory_config_json_is_planned(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = job("model=llama-3.1-8b", f"model.path={tmp_path}", "head=eagle3", "plan.gpus=1", "plan.gpu_memory=80GB")
    arch = read_arch(cfg.model)
    assert arch.source == str(tmp_path / "config.json")  # the directory wins over the group's model.arch
    assert arch.num_parameters == read_arch(job("model=llama-3.1-8b").model).num_parameters
    text = dry_run(cfg)
    assert f"sizes from {tmp_path / 'config.json'}" in text and text.splitlines()[-1].startswith("verdict: (a)")
    (tmp_path / "config.json").unlink()
    with pytest.raises(SpecHeadsError, match="no config.json"):
        read_arch(cfg.model)


def test_dry_run_loads_nothing(monkeypatch, capsys):
    import specheads.train.run as run

    def forbidden(*args, **kwargs):
        raise AssertionError("a dry run must not set up ranks or load the target")

    monkeypatch.setattr(run, "process_group", forbidden)
    monkeypatch.setattr(run, "load_target", forbidden)
    cfg = job("model=llama-70b", "head=eagle", "dry_run=true", "plan.gpus=8", "plan.gpu_memory=80GB")
    assert run.train(cfg) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("verdict: (b)") and any(line.startswith("disk ") for line in lines)


def test_a_run_that_cannot_fit_is_refused_before_loading():
    cfg = job("model=llama-70b", "head=eagle", "plan.gpu_memory=80GB")
    with pytest.raises(SpecHeadsError, match=r"whole target does not fit: 148\.\d GB per rank .* 72\.0 GB usable"):
        check_fits(cfg, world=8, on_gpu=True)
    warning = check_fits(dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, check=False)), 8, True)
    assert warning.startswith("warning: the whole target does not fit")
    fits = job("model=llama-3.1-8b", "head=eagle3", "plan.gpu_memory=80GB")
    assert check_fits(fits, world=1, on_gpu=True) is None
    # a plan that cannot be made warns and blocks nothing
    unknown = dataclasses.replace(fits, head=dataclasses.replace(fits.head, family="no-such-family"))
    assert check_fits(unknown, world=1, on_gpu=True).startswith("warning: memory plan skipped")
    # a CPU run with no GPU declared is not checked (the default run is unchanged)
    assert check_fits(job(), world=1, on_gpu=False) is None
    assert check_fits(job("model=llama-70b"), world=1, on_gpu=False) is None


def clean_env(tmp_path: Path) -> dict:
    """No network and an empty Hub cache: anything that tried to download would fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return env


def train_py(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "train.py", *args, f"output_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict:
    """The module's train.py dry runs, side by side: name -> (finished process, its directory)."""
    commands = {
        "plan": ("model=llama-70b", "head=eagle", "dry_run=true", "plan.gpus=8", "plan.gpu_memory=80GB"),
        "unreachable": ("model=llama-70b", "model.arch=null", "dry_run=true"),
    }
    dirs = {name: tmp_path_factory.mktemp(name) for name in commands}
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda name: train_py(dirs[name], *commands[name]), commands))
    return {name: (proc, dirs[name]) for name, proc in zip(commands, procs)}


def test_train_py_dry_run_prints_the_plan_and_exits_0(dry_runs):
    proc, tmp_path = dry_runs["plan"]
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("target  llama-3.3-70b: 70.6B parameters") and "(sizes from model.arch)" in lines[0]
    assert any(line.startswith("target weights (bf16)") and "141.1" in line for line in lines)
    assert lines[-1].startswith("verdict: (b) online, the target sharded over 8 ranks")
    assert any(line.strip().startswith("8  (b) sharded") for line in lines)  # the time per GPU count
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "hf" / "hub").exists()


def test_train_py_dry_run_of_an_unreachable_hub_id_is_one_line(dry_runs):
    proc, _ = dry_runs["unreachable"]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot fetch the config.json of"), proc.stderr
    assert "meta-llama/Llama-3.3-70B-Instruct" in lines[0] and "model.arch" in lines[0]


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text", "qwen3_next", "falcon_h1"]
)
def test_expert_and_hybrid_targets_count_as_the_model_built_from_their_config(model_type):
    """Every expert counts (the weights fill memory), as in the model transformers builds."""
    from specheads.tiny import tiny_target

    arch = read_arch(ModelConfig(name=model_type, path=f"tiny:{model_type}", tiny={"num_hidden_layers": 4}))
    model, _ = tiny_target(model_type, num_hidden_layers=4)
    assert arch.num_parameters == sum(p.numel() for p in model.parameters())
    assert arch.info.model_type == model_type


def test_the_active_count_keeps_the_routed_experts_a_token_runs_through():
    """A token runs through num_experts_per_tok of each layer's routed experts (SwiGLU: 3 x hidden x
    moe_intermediate each), the shared experts and everything else: the tiny types by hand, and
    DeepSeek-V3's own config (671B parameters, 37B activated: its paper's numbers)."""
    from transformers import AutoConfig

    from specheads.train.arch import from_hf_config

    def tiny(model_type):
        return read_arch(ModelConfig(name=model_type, path=f"tiny:{model_type}", tiny={"num_hidden_layers": 4}))

    expert = 3 * 64 * 32  # hidden 64, moe_intermediate_size 32
    moe = tiny("qwen3_moe")  # 4 MoE layers, 2 of 4 experts chosen
    assert moe.active_parameters == moe.num_parameters - 4 * (4 - 2) * expert
    deepseek = tiny("deepseek_v3")  # the first layer dense, a shared expert beside the routed ones
    assert deepseek.active_parameters == deepseek.num_parameters - 3 * (4 - 2) * expert
    full = from_hf_config("deepseek-v3", AutoConfig.for_model("deepseek_v3"), "DeepSeek-V3's config")
    assert round(full.num_parameters / 1e9) == 671 and 37e9 <= full.active_parameters < 38e9
    cfg = job("model=tiny-random", "model.path=tiny:qwen3_moe", "head=eagle3")
    planned = read_arch(cfg.model)
    shown = f"{planned.num_parameters / 1e6:.1f}M parameters ({planned.active_parameters / 1e6:.1f}M active per token)"
    assert shown in dry_run(cfg)
