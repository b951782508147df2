"""The memory plan of a training run, from the target's sizes alone (specheads.train.arch).

Per rank it counts the frozen target's weights, the head's parameters, gradients and AdamW states
under the run's ZeRO stage, and an estimate of the activations of one micro-batch, for three ways
of running, and picks the first that fits the GPUs:
  (a) online, the whole target on every rank (what train.py does);
  (b) online, the target's decoder layers sharded across the ranks (one gathered at a time), its
      embedding and LM head whole on every rank;
  (c) offline features: the states read from a cache on disk, only the embedding and LM head on
      the GPU (the cache is written by one target pass: distill.py or data.features=auto);
  (d) none: refused, with the numbers.
train.py runs (a) when it fits, else (b) (shard_decision); (c) says what offline features would
take: train.py loads the whole target beside them, so they save the activations, not the weights.
A run is refused unless what it runs fits (check_fits, before anything is loaded).

Bytes follow the ZeRO paper: with bf16 weights, 2 bytes a parameter each for the weights and the
gradients, 12 for the optimizer (fp32 master copy + Adam's two moments); stage 1 shards the
optimizer states across the ranks, stage 2 the gradients too, stage 3 the parameters too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from ..config.train import TrainJobConfig
from ..errors import SpecHeadsError
from ..heads import HEADS, DraftHead
from ..heads.spec import BLOCK_FAMILIES, FUSED_FAMILIES, HeadSpec
from ..target import TargetInfo, resolve_dtype
from .arch import TargetArch, read_arch

GB = 10**9
# of a GPU's memory, what the plan may use: the rest is for the CUDA context, NCCL and DeepSpeed's
# communication buckets, and the allocator's fragmentation
USABLE = 0.9
ASSUMED_TOKENS = 1_000_000
UNKNOWN_TOKENS = "assumed; set plan.tokens or budget.conversations"
FEATURE_BYTES = 2  # feature caches hold bf16 states on GPU runs
# bytes per element kept by an explicitly computed attention (TTT steps >= 1 of EAGLE-1/3's draft
# layer): bf16 scores, their fp32 softmax and its bf16 copy
SCORE_BYTES = 8
MODES = ("replicated", "sharded", "offline")
TITLES = {
    "replicated": ("(a) online", "whole target"),
    "sharded": ("(b) online", "target sharded"),
    "offline": ("(c) offline", "features"),
}
UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "tb": 10**12, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes of "80GB" (10^9 bytes a GB), "80GiB" (2^30), also MB, MiB, TB, TiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise SpecHeadsError(f"plan.gpu_memory={text!r}: write a size such as 80GB or 80GiB")
    return int(float(match.group(1)) * UNITS[unit])


def _meta_head(spec: HeadSpec, info: TargetInfo) -> DraftHead:
    """The head `spec` builds, on the meta device: its shapes without its memory."""
    if spec.family not in HEADS:
        raise SpecHeadsError(f"unknown head family {spec.family!r}")
    with torch.device("meta"):
        return HEADS[spec.family](spec, info)


def head_parameters(spec: HeadSpec, info: TargetInfo) -> int:
    """The parameter count of the head `spec` builds (counted on the meta device, so any family
    and any size is exact and costs no memory), with the target adapter it trains (Medusa-2's LoRA)."""
    head = _meta_head(spec, info)
    return sum(p.numel() for p in head.parameters()) + head.target_adapter_parameters(spec, info)


def state_count(spec: HeadSpec, info: TargetInfo) -> int:
    """Target states a head trains on: the layers it reads and the post-norm final state."""
    layer_ids, final = _meta_head(spec, info).training_states()
    return len(layer_ids) + int(final)


@dataclass(frozen=True)
class Usage:
    """Bytes per rank."""

    target: float
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.target + self.params + self.grads + self.optimizer + self.activations


def head_state(
    n: int, stage: int, world: int, weight_bytes: int, offload_optimizer: bool = False, offload_param: bool = False
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes per rank of a head of n parameters."""
    if stage not in (0, 1, 2, 3):
        raise SpecHeadsError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {stage}")
    optimizer_bytes = 12 if weight_bytes < 4 else 8  # mixed precision adds an fp32 master copy
    params = n * weight_bytes / (world if stage >= 3 else 1)
    grads = n * weight_bytes / (world if stage >= 2 else 1)
    optimizer = n * optimizer_bytes / (world if stage >= 1 else 1)
    return (0.0 if offload_param else params), grads, (0.0 if offload_optimizer else optimizer)


def layer_activations(info: TargetInfo, tokens: int, weight_bytes: int, width: int, intermediate: int) -> float:
    """What one decoder layer keeps for its backward: input, q/k/v, attention output, residual,
    norm, and the MLP's gate, up, activation and product."""
    q, kv = info.num_attention_heads * info.head_dim, info.num_key_value_heads * info.head_dim
    return tokens * weight_bytes * (width + 2 * q + 2 * kv + 3 * info.hidden_size + 4 * intermediate)


def activations(
    info: TargetInfo, spec: HeadSpec, batch: int, length: int, weight_bytes: int, online: bool, packed: bool = False
) -> float:
    """An estimate (not a measurement) of a micro-batch's peak, bytes per rank.

    Counted: the target states the head reads (captured by a forward, or read from the cache);
    online, one target decoder layer's tensors (no grad: the layers do not pile up), or every
    layer's when the head trains an adapter inside the target (Medusa-2: its backward needs them);
    the target's fp32 logits, which every family's loss reads; then per draft step (Medusa head,
    EAGLE-1's one step, EAGLE-3's ttt_steps, the early-exit adapter) the draft layers' saved
    tensors, the fp32 draft logits with their log-softmax and target distribution, and, for
    EAGLE-3's steps after the first, the
    attention scores the unrolled draft computes explicitly ([B, heads, T, T]). Left out: the
    padding-free small tensors, and the evaluation passes (no grad, smaller). `packed` (data.pack):
    a row holds several conversations, and DFlash draws its anchors for each of them.
    """
    h, v, n = info.hidden_size, info.vocab_size, batch * length
    head = HEADS[spec.family]
    total = state_count(spec, info) * n * h * weight_bytes + n * v * 4
    if online:
        layers = info.num_layers if head.adapts_target else 1
        total += layers * layer_activations(info, n, weight_bytes, h, info.intermediate_size)
    if spec.family in BLOCK_FAMILIES:
        return total + dflash_activations(info, spec, batch, length, weight_bytes, packed)
    if head.draft_kind == "early_exit":  # one adapter layer over the layer-L states, the target's LM head
        adapter = layer_activations(info, n, weight_bytes, h, spec.intermediate_size if spec.adapter_mlp else 0)
        return total + adapter + 3 * n * v * 4
    if head.draft_kind not in ("autoregressive", "parallel_decoder"):  # Medusa, Hydra: a block stack per head
        per_head = n * v * (weight_bytes + 8) + spec.num_layers * 2 * n * h * weight_bytes
        return total + spec.num_heads * per_head
    fused = spec.family in FUSED_FAMILIES
    vd = spec.draft_vocab_size if fused else v
    factor = 2 if fused else 1
    layers = sum(
        layer_activations(info, n, weight_bytes, h * factor if i == 0 else h, spec.intermediate_size)
        for i in range(spec.num_decoder_layers)
    )
    fuse_in = (len(spec.layer_ids) if fused else 2) * n * h * weight_bytes
    if head.draft_kind == "parallel_decoder":
        # P-EAGLE: one forward over the packed depths (COD sampling's expected rows per position),
        # its masked attention over the packed rows, and the gathered target distributions
        rows = 1 + sum(max(spec.depth_keep_rate**d, spec.depth_min_rate) for d in range(1, spec.parallel_depths))
        packed = int(rows * length)
        scores = batch * info.num_attention_heads * packed * packed * SCORE_BYTES * spec.num_decoder_layers
        return total + fuse_in + int(rows * (layers + 4 * n * vd * 4)) + scores + batch * packed * packed
    steps = spec.ttt_steps if fused else 1
    scores = batch * info.num_attention_heads * length * length * SCORE_BYTES * spec.num_decoder_layers
    total += fuse_in + steps * (layers + 3 * n * vd * 4) + (steps - 1) * scores
    if fused:
        total += n * vd * 4  # the target's logits over the draft vocab
    return total


def dflash_activations(
    info: TargetInfo, spec: HeadSpec, batch: int, length: int, weight_bytes: int, packed: bool = False
) -> float:
    """DFlash: the fused context (fc input and output, its keys and values in every layer), one
    forward over anchors x block_size rows (at most one anchor per position; a packed row draws
    anchors_per_sequence for each of its conversations, so up to one per position), its masked
    attention over context + rows, and the fp32 logits with their log-softmax of the drafting rows
    (DSpark: also its Markov bias and the target's logits there, for its confidence targets)."""
    h, n = info.hidden_size, batch * length
    rows = batch * (length if packed else min(spec.anchors_per_sequence, length)) * spec.block_size
    kv = info.num_key_value_heads * info.head_dim
    context = (len(spec.layer_ids) + 2) * n * h * weight_bytes + spec.dflash_layers * 2 * n * kv * weight_bytes
    layers = spec.dflash_layers * layer_activations(info, rows, weight_bytes, h, spec.intermediate_size)
    per_query = rows // batch + length
    scores = rows * info.num_attention_heads * per_query * SCORE_BYTES * spec.dflash_layers + rows * per_query
    logits = (4 if spec.family == "dspark" else 2) * rows * info.vocab_size * 4
    return context + layers + scores + logits


@dataclass(frozen=True)
class Gpus:
    count: int
    memory: int  # bytes per GPU
    source: str  # "declared" or "visible"

    @property
    def usable(self) -> float:
        return self.memory * USABLE


@dataclass(frozen=True)
class Plan:
    arch: TargetArch
    spec: HeadSpec
    head_parameters: int
    zero_stage: int
    world: int
    batch: int
    length: int
    weight_bytes: int
    gpus: Gpus | None
    usage: dict[str, Usage]  # per mode (MODES), bytes per rank
    disk: float  # bytes of the feature cache (c) reads
    tokens: int
    tokens_note: str
    choice: str | None  # the first mode that fits; None when nothing fits or no GPU is known

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes worth showing: sharding over one rank is (a) again; a head that trains an adapter
        inside the target (Medusa-2) reads the adapted target's own states, which no cache holds."""
        modes = MODES if self.world > 1 else ("replicated", "offline")
        return tuple(m for m in modes if m != "offline" or not HEADS[self.spec.family].adapts_target)

    def fits(self, mode: str) -> bool:
        return self.gpus is not None and self.usage[mode].total <= self.gpus.usable


def feature_tokens(cfg: TrainJobConfig) -> tuple[int, str]:
    """How many tokens a feature cache would hold, and where that number comes from."""
    if cfg.plan.tokens is not None:
        return cfg.plan.tokens, "plan.tokens"
    if cfg.budget.conversations is not None:
        conversation = min(cfg.budget.mean_tokens, cfg.data.max_length)
        return (
            cfg.budget.conversations * conversation,
            f"{cfg.budget.conversations:,} conversations x ~{conversation:,} tokens",
        )
    if cfg.data.max_examples is not None:
        return cfg.data.max_examples * cfg.data.max_length, "data.max_examples x data.max_length, at most"
    return ASSUMED_TOKENS, UNKNOWN_TOKENS


def make_plan(cfg: TrainJobConfig, arch: TargetArch, gpus: Gpus | None, world: int | None = None) -> Plan:
    """The per-rank usage of every mode, and the first that fits `gpus` (world: gpus.count, or 1)."""
    info = arch.info
    spec = HeadSpec.from_config(cfg.head, info)
    n_head = head_parameters(spec, info)
    world = world or (gpus.count if gpus else 1)
    weight_bytes = resolve_dtype(cfg.model.dtype, torch.device("cuda")).itemsize  # auto = bf16 on GPU
    z = cfg.deepspeed
    params, grads, optimizer = head_state(
        n_head, z.zero_stage, world, weight_bytes, z.offload_optimizer, z.offload_param
    )
    batch, length = cfg.train.batch_size, cfg.data.max_length

    def usage(target_params: float, online: bool) -> Usage:
        acts = activations(info, spec, batch, length, weight_bytes, online, cfg.data.pack)
        return Usage(target_params * weight_bytes, params, grads, optimizer, acts)

    layers = info.num_layers * arch.layer_parameters
    whole = arch.num_parameters
    sharded = math.ceil(layers / world) + arch.layer_parameters + arch.vocab_parameters
    usages = {
        "replicated": usage(whole, True),
        "sharded": usage(min(sharded, whole), True),
        "offline": usage(arch.vocab_parameters, False),
    }
    tokens, note = feature_tokens(cfg)
    disk = tokens * state_count(spec, info) * info.hidden_size * FEATURE_BYTES
    plan = Plan(
        arch=arch,
        spec=spec,
        head_parameters=n_head,
        zero_stage=z.zero_stage,
        world=world,
        batch=batch,
        length=length,
        weight_bytes=weight_bytes,
        gpus=gpus,
        usage=usages,
        disk=disk,
        tokens=tokens,
        tokens_note=note,
        choice=None,
    )
    return replace(plan, choice=next((m for m in plan.modes if plan.fits(m)), None))


def gb(n: float) -> str:
    return f"{n / GB:.1f}"


def millions(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def verdict(plan: Plan) -> str:
    """One line: the chosen mode and why, or the refusal with the numbers."""
    if plan.gpus is None:
        return "verdict: no GPU memory known (none visible, plan.gpu_memory unset): set plan.gpu_memory=80GB"
    u, usable = plan.usage, gb(plan.gpus.usable)
    whole = f"the whole target needs {gb(u['replicated'].total)} GB per rank"
    if plan.choice == "replicated":
        return f"verdict: (a) online, the whole target on every rank: {gb(u['replicated'].total)} of {usable} GB usable"
    if plan.choice == "sharded":
        return (
            f"verdict: (b) online, the target sharded over {plan.world} ranks: {gb(u['sharded'].total)} of {usable} "
            f"GB usable per rank ({whole}); train.py shards it (deepspeed.shard_target, ZeRO-3 inference)"
        )
    if plan.choice == "offline":
        return (
            f"verdict: (c) offline features (data.features): {gb(u['offline'].total)} of {usable} GB usable per "
            f"rank and {gb(plan.disk)} GB of disk ({whole}); train.py still loads the whole target beside the "
            "features and refuses this run"
        )
    needs = ", ".join(f"{TITLES[m][0][:3]} {gb(u[m].total)}" for m in plan.modes)
    zero3 = ", deepspeed=zero3" if plan.zero_stage < 3 else ""
    return (
        f"verdict: (d) refused: nothing fits {usable} GB usable per rank ({needs} GB); "
        f"use more or larger GPUs{zero3}, or a smaller train.batch_size or data.max_length"
    )


def format_plan(plan: Plan) -> str:
    """The readable per-rank table, its assumptions, then the verdict line."""
    info, spec, modes = plan.arch.info, plan.spec, plan.modes
    dtype = {2: "bf16", 4: "fp32"}.get(plan.weight_bytes, f"{plan.weight_bytes}-byte")
    gpus = (
        "none visible or declared"
        if plan.gpus is None
        else (
            f"{plan.gpus.count} x {gb(plan.gpus.memory)} GB ({plan.gpus.source}), "
            f"{gb(plan.gpus.usable)} GB usable each ({USABLE:.0%})"
        )
    )
    active = plan.arch.active_parameters
    active = (
        f" ({millions(active)} active per token)" if active is not None and active != plan.arch.num_parameters else ""
    )
    lines = [
        f"target  {info.name}: {millions(plan.arch.num_parameters)} parameters{active}, {info.num_layers} layers, "
        f"hidden {info.hidden_size}, vocab {info.vocab_size} (sizes from {plan.arch.source})",
        f"head    {spec.family}: {millions(plan.head_parameters)} parameters",
        f"run     ZeRO-{plan.zero_stage} over {plan.world} rank{'s' if plan.world > 1 else ''}, "
        f"{plan.batch} rows x {plan.length} tokens per rank, {dtype} weights",
        f"GPUs    {gpus}",
        "",
    ]
    rows = [
        ("per rank, GB", *(TITLES[m][0] for m in modes)),
        ("", *(TITLES[m][1] for m in modes)),
        (f"target weights ({dtype})", *(gb(plan.usage[m].target) for m in modes)),
        ("head parameters", *(gb(plan.usage[m].params) for m in modes)),
        ("head gradients", *(gb(plan.usage[m].grads) for m in modes)),
        ("optimizer (AdamW)", *(gb(plan.usage[m].optimizer) for m in modes)),
        ("activations (estimate)", *(gb(plan.usage[m].activations) for m in modes)),
        ("total", *(gb(plan.usage[m].total) for m in modes)),
    ]
    if plan.gpus is not None:
        rows.append(("fits", *("yes" if plan.fits(m) else "no" for m in modes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(max(widths[i + 1], 14)) for i, c in enumerate(row[1:])]
        lines.append("  ".join(cells).rstrip())
    n_states = state_count(spec, info)
    states = f"{n_states} state{'s' if n_states > 1 else ''}"
    lines.append("")
    if "sharded" in modes:
        lines.append(
            f"(b) 1/{plan.world} of the decoder layers per rank, one more gathered at a time; "
            "the embedding and LM head whole"
        )
    if "offline" in modes:
        lines.append(
            f"(c) disk: {gb(plan.disk)} GB of bf16 features for {plan.tokens:,} tokens ({plan.tokens_note}), "
            f"{states} x hidden {info.hidden_size} x 2 bytes a token"
        )
    lines.append(verdict(plan))
    return "\n".join(lines)


def visible_gpus() -> tuple[int, int]:
    """(count, bytes of the smallest) of the GPUs torch sees; (0, 0) on a CPU machine."""
    if not torch.cuda.is_available():
        return 0, 0
    n = torch.cuda.device_count()
    return n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n))


def planned_gpus(cfg: TrainJobConfig, world: int | None = None) -> Gpus | None:
    """The GPUs to plan for: plan.gpus / plan.gpu_memory where declared, else the visible ones;
    a launched run (world given) plans for its own ranks. None when no GPU memory is known."""
    count, memory = visible_gpus()
    declared = cfg.plan.gpu_memory is not None or (cfg.plan.gpus is not None and world is None)
    if cfg.plan.gpu_memory is not None:
        memory = parse_memory(cfg.plan.gpu_memory)
    if world is not None:
        count = world
    elif cfg.plan.gpus is not None:
        if cfg.plan.gpus < 1:
            raise SpecHeadsError(f"plan.gpus must be >= 1, got {cfg.plan.gpus}")
        count = cfg.plan.gpus
    if not memory or not count:
        return None
    return Gpus(count, memory, "declared" if declared else "visible")


def dry_run(cfg: TrainJobConfig, arch: TargetArch | None = None) -> str:
    """train.py dry_run=true: the plan for the declared or visible GPUs, nothing loaded (`arch`:
    the target's sizes when the caller has read them already)."""
    gpus = planned_gpus(cfg)
    world = gpus.count if gpus else (cfg.plan.gpus or 1)
    return format_plan(make_plan(cfg, arch or read_arch(cfg.model), gpus, world))


def shard_decision(cfg: TrainJobConfig, world: int, on_gpu: bool) -> bool:
    """Whether train.py shards the frozen target: deepspeed.shard_target when set, else the plan's
    choice (b): the whole target does not fit a rank but its shard does (GPU runs with a plan)."""
    if cfg.deepspeed.shard_target is not None:
        return bool(cfg.deepspeed.shard_target)
    if world < 2 or (not on_gpu and cfg.plan.gpu_memory is None):
        return False
    gpus = planned_gpus(cfg, world)
    if gpus is None:
        return False
    try:
        plan = make_plan(cfg, read_arch(cfg.model), gpus, world)
    except SpecHeadsError:
        return False
    return not plan.fits("replicated") and plan.fits("sharded")


def check_fits(cfg: TrainJobConfig, world: int, on_gpu: bool, sharded: bool = False) -> str | None:
    """Before a run loads anything, whether what train.py does ((a), or (b) when `sharded`) fits a
    rank: SpecHeadsError when not (a warning line instead with plan.check=false), a warning line
    when no plan can be made, None when it fits or nothing is checked (a CPU run with no
    plan.gpu_memory)."""
    if not on_gpu and cfg.plan.gpu_memory is None:
        return None
    gpus = planned_gpus(cfg, world)
    if gpus is None:
        return None
    try:  # a plan that cannot be made (sizes unreadable, a family it does not know) blocks no run
        plan = make_plan(cfg, read_arch(cfg.model), gpus, world)
    except SpecHeadsError as err:
        return f"warning: memory plan skipped: {err}"
    mode = "sharded" if sharded and "sharded" in plan.modes else "replicated"
    need = plan.usage[mode]
    if cfg.data.features and cfg.data.features != "auto":  # no target forwards; the target is loaded all the same
        need = replace(need, activations=plan.usage["offline"].activations)
    if need.total <= gpus.usable:
        return None
    hints = {"sharded": "deepspeed.shard_target=true", "offline": "which train.py does not do yet"}
    others = [
        f"{TITLES[m][0]} {TITLES[m][1]} {gb(plan.usage[m].total)} GB ({hints[m]})"
        for m in plan.modes
        if m != mode and m in hints and plan.fits(m)
    ]
    what = "the target's shard" if mode == "sharded" else "the whole target"
    message = (
        f"{what} does not fit: {gb(need.total)} GB per rank (target {gb(need.target)}, head state "
        f"{gb(need.params + need.grads + need.optimizer)}, activations {gb(need.activations)}) > "
        f"{gb(gpus.usable)} GB usable ({USABLE:.0%} of {gb(gpus.memory)} GB)"
        + (f"; would fit: {', '.join(others)}" if others else "")
        + "; see dry_run=true, or plan.check=false to run anyway"
    )
    if not cfg.plan.check:
        return f"warning: {message}"
    raise SpecHeadsError(message)
