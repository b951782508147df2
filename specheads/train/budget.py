"""What a run on a real target needs before it starts, and what its budget costs in time and disk.

A head trained on a few hundred conversations, or for a sliver of an epoch, accepts little more
than no head: on a real target (budget.real_target_parameters, 1B by default) that costs hours of
GPUs for nothing, so train.py refuses, in one line, before the target is loaded:
  - data.path=builtin (the conversations the target writes for itself on the fly), naming the
    distill.py commands that make its data (the recipe's budget.make_data, else one for any
    target), how many conversations, and the GPU time the training would take;
  - once the training rows are known, a budget of less than budget.min_epochs of them.
budget.allow_toy=true runs either anyway, and says so.

dry_run=true adds to the memory plan (specheads.train.plan), before its verdict line, per GPU count: the mode train.py
would run, memory per rank, tokens per second (specheads.train.throughput, an estimate fitted to
measured runs) and the wall time of the budget; and the disk offline features take, against the
free space where they would be written. A cache the disk cannot hold is refused there before
anything is written (and by the feature writer itself, before its first shard).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import model_option
from ..config.train import TrainJobConfig
from ..data.features import check_disk
from ..errors import SpecHeadsError
from ..heads import HEADS
from ..heads.spec import BLOCK_FAMILIES
from ..target import cache_root
from .arch import TargetArch, read_arch
from .plan import UNKNOWN_TOKENS, Gpus, Plan, feature_tokens, gb, make_plan, parse_memory
from .plan import dry_run as memory_plan
from .throughput import DEFAULT_GPU, FIT, GPUS, Work, tokens_per_second

GPU_COUNTS = (1, 2, 4, 8, 16)
# a run with no recipe for its target: what the reference trainers treat as enough data for a
# first real head (NeMo AutoModel: 200K target-answered conversations for one epoch of an 8B)
DEFAULT_CONVERSATIONS = 200_000


@dataclass(frozen=True)
class Budget:
    """The tokens a run trains on and the tokens its data holds (None: unknown), and why."""

    train_tokens: float | None
    data_tokens: float | None
    note: str


def row_tokens(cfg: TrainJobConfig) -> int:
    """Tokens in a training row: a packed row is full, an unpacked one is a conversation."""
    return cfg.data.max_length if cfg.data.pack else min(cfg.budget.mean_tokens, cfg.data.max_length)


def budget(cfg: TrainJobConfig, world: int) -> Budget:
    tokens, note = feature_tokens(cfg)
    data = None if note == UNKNOWN_TOKENS else tokens
    if data is None:
        note = "the data's size unknown: set budget.conversations"
    if cfg.train.epochs is not None:
        train = None if data is None else cfg.train.epochs * data
        return Budget(train, data, f"{cfg.train.epochs:g} epochs of {note}")
    t = cfg.train
    train = t.max_steps * t.grad_accum * world * t.batch_size * row_tokens(cfg)
    rows = f"{t.max_steps:,} steps x {t.grad_accum * world * t.batch_size} rows of ~{row_tokens(cfg):,} tokens"
    return Budget(train, data, f"{rows} ({note})")


def draft_passes(plan: Plan) -> float:
    """The head's forwards per training token."""
    spec = plan.spec
    if spec.family == "eagle3":
        return spec.ttt_steps
    if spec.family == "peagle":  # COD sampling's expected rows per position
        return 1 + sum(max(spec.depth_keep_rate**d, spec.depth_min_rate) for d in range(1, spec.parallel_depths))
    if spec.family in BLOCK_FAMILIES:  # anchors x block rows over the sequence
        return spec.block_size * min(spec.anchors_per_sequence, plan.length) / plan.length
    return 1.0


def head_layers(plan: Plan) -> int:
    spec = plan.spec
    if spec.family in BLOCK_FAMILIES:
        return spec.dflash_layers
    if HEADS[spec.family].draft_kind in ("autoregressive", "parallel_decoder"):
        return spec.num_decoder_layers
    return 0


def work(plan: Plan, cfg: TrainJobConfig, online: bool) -> Work:
    arch = plan.arch
    info = arch.info
    return Work(
        target_parameters=arch.active_parameters or arch.num_parameters,
        target_layers=info.num_layers,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        head_parameters=plan.head_parameters,
        head_layers=head_layers(plan),
        draft_passes=draft_passes(plan),
        context=max(1, row_tokens(cfg) // 2),
        online=online,
    )


def gpu_type(cfg: TrainJobConfig) -> str:
    """plan.gpu, else the visible GPU's type where its name says, else h100."""
    if cfg.plan.gpu is not None:
        name = cfg.plan.gpu.lower()
        if name not in GPUS:
            raise SpecHeadsError(f"plan.gpu={cfg.plan.gpu!r}: the time model knows {', '.join(GPUS)}")
        return name
    import torch

    if torch.cuda.is_available():
        visible = torch.cuda.get_device_name(0).lower()
        for name in GPUS:
            if name in visible:
                return name
    return DEFAULT_GPU


def offline(cfg: TrainJobConfig) -> bool:
    """The run reads its states from a cache (data.features names one): the target does not run."""
    return bool(cfg.data.features) and cfg.data.features != "auto"


def hours(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Timing:
    gpus: int
    mode: str | None  # what train.py runs there, None when nothing it runs fits
    memory: float  # bytes per rank of that mode
    tokens_per_s: float  # all GPUs together
    seconds: float | None  # the budget's wall time


def timings(cfg: TrainJobConfig, arch: TargetArch, memory: int | None, gpu: str) -> list[Timing]:
    """Per GPU count: the mode train.py would run, its memory per rank, speed and wall time."""
    counts = sorted({*GPU_COUNTS, *([cfg.plan.gpus] if cfg.plan.gpus else [])})
    rows = []
    for n in counts:
        plan = make_plan(cfg, arch, Gpus(n, memory, "declared") if memory else None, n)
        runs = ["offline"] if offline(cfg) else ["replicated", "sharded"]
        mode = next((m for m in runs if m in plan.modes and plan.fits(m)), None)
        shown = mode or runs[0]
        per_gpu = tokens_per_second(work(plan, cfg, not offline(cfg)), cfg.train.batch_size * row_tokens(cfg), gpu)
        total = budget(cfg, n).train_tokens
        rows.append(
            Timing(n, mode, plan.usage[shown].total, per_gpu * n, None if total is None else total / (per_gpu * n))
        )
    return rows


def time_lines(cfg: TrainJobConfig, arch: TargetArch) -> list[str]:
    gpu = gpu_type(cfg)
    memory = parse_memory(cfg.plan.gpu_memory) if cfg.plan.gpu_memory else None
    b = budget(cfg, cfg.plan.gpus or 1)
    lines = [
        "",
        f"time    on {gpu} GPUs (dense bf16 {GPUS[gpu] / 1e12:.0f} TFLOP/s), an ESTIMATE: the throughput model "
        f"(specheads/train/throughput.py) fitted to measured runs, {FIT.efficiency:.0%} of the peak and "
        f"{FIT.overhead * 1e3:.0f} ms a micro-batch",
        f"budget  {b.note}" + ("" if b.train_tokens is None else f" = {b.train_tokens / 1e6:,.0f}M tokens"),
        "",
    ]
    table = [("GPUs", "runs", "GB per rank", "tokens/s", "wall time", "GPU-hours")]
    for t in timings(cfg, arch, memory, gpu):
        mode = {"replicated": "(a) whole", "sharded": "(b) sharded", "offline": "(c) features", None: "no fit"}[t.mode]
        if memory is None:
            mode = "?"
        wall = "-" if t.seconds is None else hours(t.seconds)
        gpu_hours = "-" if t.seconds is None else f"{t.seconds * t.gpus / 3600:,.1f}"
        table.append((str(t.gpus), mode, gb(t.memory), f"{t.tokens_per_s:,.0f}", wall, gpu_hours))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    if memory is None:
        lines.append("(no GPU memory declared: plan.gpu_memory=80GB says which mode fits)")
    lines.append("(b) also gathers the target's layers every forward, which the model does not count")
    return lines


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def feature_directory(cfg: TrainJobConfig) -> Path | None:
    """Where this run writes a feature cache: data.features=auto's cache root; None when it writes none."""
    return cache_root() / "features" if cfg.data.features == "auto" else None


def disk_lines(cfg: TrainJobConfig, arch: TargetArch) -> list[str]:
    """Where this run would write the feature cache that (c) above sizes, and the room there."""
    directory = feature_directory(cfg)
    if directory is None:
        return ["", "disk    this run writes no feature cache ((c) above: data.features=auto writes one)"]
    plan = make_plan(cfg, arch, None, 1)
    where = nearest_existing(directory)
    free = shutil.disk_usage(where).free
    fits = "fits" if plan.disk <= free else "does NOT fit"
    return ["", f"disk    the feature cache ({gb(plan.disk)} GB) under {where}: {gb(free)} GB free, {fits}"]


def dry_run(cfg: TrainJobConfig) -> str:
    """train.py dry_run=true: the memory plan, the time per GPU count, the disk; nothing loaded."""
    arch = read_arch(cfg.model)
    *table, verdict = memory_plan(cfg, arch).split("\n")  # the verdict stays the last line (docs/contracts.md)
    text = "\n".join([*table, *time_lines(cfg, arch), *disk_lines(cfg, arch)[1:], "", verdict])
    directory = feature_directory(cfg)
    if directory is not None:  # a cache the disk cannot hold: the plan, then the refusal
        plan = make_plan(cfg, arch, None, 1)
        print(text, flush=True)
        check_disk(nearest_existing(directory), int(plan.disk), plan.tokens, int(plan.disk) // max(plan.tokens, 1))
        return ""
    return text


def is_real(arch: TargetArch, cfg: TrainJobConfig) -> bool:
    return arch.num_parameters >= cfg.budget.real_target_parameters


def model_choice(cfg: TrainJobConfig) -> str:
    """The model= option of this target (its conf/model file, by the name it gives), else model.name."""
    try:
        found = model_option(cfg.model.name)
    except SpecHeadsError:  # no installed configs: the name is what there is
        found = None
    return found[0] if found else cfg.model.name


def make_data_commands(cfg: TrainJobConfig) -> list[str]:
    """The commands that make this target's data: the recipe's, else distill.py for any target."""
    if cfg.budget.make_data:
        return list(cfg.budget.make_data)
    return [
        f"python distill.py model={model_choice(cfg)} distill.prompts=sharegpt "
        f"distill.num_prompts={DEFAULT_CONVERSATIONS} distill.backend=server distill.server.url=http://HOST:PORT/v1"
    ]


def toy(cfg: TrainJobConfig, message: str) -> None:
    """Refuse a run that could only make a useless head, unless budget.allow_toy."""
    if not cfg.budget.allow_toy:
        raise SpecHeadsError(f"{message}; budget.allow_toy=true runs it anyway")
    print(f"warning: {message} (running anyway: budget.allow_toy=true)", file=sys.stderr)


def check_real_target(cfg: TrainJobConfig) -> None:
    """Before the target is loaded: a real target with data.path=builtin is refused, and so is a
    recipe whose data has not been made yet; both name the commands that make it."""
    missing = [p for p in (cfg.data.path, *cfg.data.mix) if p != "builtin" and not Path(p).exists()]
    if cfg.data.path != "builtin" and not (cfg.budget.make_data and missing):
        return
    try:
        arch = read_arch(cfg.model)
    except SpecHeadsError:
        return  # sizes unreadable: the load that follows says what is wrong
    if cfg.data.path == "builtin":
        if not is_real(arch, cfg):
            return
        why = (
            f"model={model_choice(cfg)} has {arch.num_parameters / 1e9:.1f}B parameters: data.path=builtin "
            f"({cfg.data.builtin_examples} conversations it writes on the fly) would train a useless head"
        )
        toy(cfg, f"{why}. {data_first(cfg, arch)}")
        return
    raise SpecHeadsError(f"the recipe's data {', '.join(missing)} is not there yet. {data_first(cfg, arch)}")


def data_first(cfg: TrainJobConfig, arch: TargetArch) -> str:
    """What to run first: the commands, the conversations, and the training's GPU time."""
    conversations = cfg.budget.conversations or DEFAULT_CONVERSATIONS
    estimate = replace_budget(cfg, conversations)
    gpus = cfg.plan.gpus or 8  # the GPU-hours hardly depend on it: a node's worth
    plan = make_plan(estimate, arch, None, gpus)
    gpu = gpu_type(cfg)
    per_gpu = tokens_per_second(work(plan, estimate, True), estimate.train.batch_size * row_tokens(estimate), gpu)
    hours_ = budget(estimate, gpus).train_tokens / per_gpu / 3600
    return (
        f"Make its data first, {conversations:,} conversations answered by the target (a serving engine at the "
        f"URL): {' && '.join(make_data_commands(cfg))}; then train on it (about {hours_:,.0f} GPU-hours of {gpu}, "
        "an estimate: dry_run=true shows it)"
    )


def replace_budget(cfg: TrainJobConfig, conversations: int) -> TrainJobConfig:
    """cfg with the data's size known and, when it trains by steps, one epoch over it."""
    train = cfg.train if cfg.train.epochs is not None else replace(cfg.train, epochs=1.0)
    return replace(cfg, budget=replace(cfg.budget, conversations=conversations), train=train)


def check_epochs(cfg: TrainJobConfig, arch_parameters: int, epochs: float, rows: int) -> None:
    """Once the rows are known: a real target's run that trains on less than budget.min_epochs of
    them (epochs: the run's steps over its batches per epoch) is refused."""
    if arch_parameters < cfg.budget.real_target_parameters or epochs >= cfg.budget.min_epochs:
        return
    toy(
        cfg,
        f"the budget trains on {epochs:.1%} of an epoch of the {rows:,} training conversations (budget.min_epochs="
        f"{cfg.budget.min_epochs:g}): set train.epochs (the recipes do) or more train.max_steps",
    )
