"""How fast a training run goes: a throughput model fitted to measured runs, for the plan's time.

A micro-batch of n tokens on one GPU takes

    t = overhead + n x flops_per_token / (peak x efficiency)

where flops_per_token counts, online, the frozen target's forward (2 x its active parameters, and
its attention over the row) and, for every draft pass the head makes in training (EAGLE-3's TTT
steps, ...), the head's forward and backward (6 x its parameters, and its attention); offline, the
target's LM head alone (the soft labels). `peak` is the GPU's dense bf16 rate (GPUS, vendor
datasheets). The two constants, `overhead` (launches, the data loader, the optimizer step: what
does not grow with the tokens) and `efficiency` (the share of the peak the matmuls reach), are
not guessed: they are solved from MEASURED, two runs at opposite ends of the scale, one of ours
and one published. The model is an estimate, and the plan says so; a measured run at the size
users train is one more row of MEASURED (a least-squares fit then, on relative error).
"""

from __future__ import annotations

from dataclasses import dataclass

# dense bf16 tensor-core peaks, FLOP/s (vendor datasheets; no sparsity)
GPUS = {
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
    "b200": 2250e12,
    "l40s": 362e12,
    "mi300x": 1307e12,
}
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class Work:
    """What one token costs a training step, the sizes flops_per_token reads."""

    target_parameters: int  # the target's parameters a token runs through (a MoE's active ones)
    target_layers: int
    hidden_size: int
    vocab_size: int
    head_parameters: int
    head_layers: int  # the head's attention layers, for its attention term
    draft_passes: float  # the head's forwards per training token (EAGLE-3: its TTT steps)
    context: int  # the mean tokens a position attends to (half the row, causal)
    online: bool  # the target runs (else its states come from a feature cache)


def flops_per_token(w: Work) -> float:
    """Training FLOPs a token costs (module docstring)."""
    if w.online:
        target = 2 * w.target_parameters + 4 * w.target_layers * w.context * w.hidden_size
    else:
        target = 2 * w.vocab_size * w.hidden_size
    head = w.draft_passes * (6 * w.head_parameters + 12 * w.head_layers * w.context * w.hidden_size)
    return target + head


@dataclass(frozen=True)
class MeasuredRun:
    """A training run whose speed was measured, a point the model is fitted to."""

    what: str
    source: str
    gpu: str
    work: Work
    tokens_per_micro_batch: int  # per GPU
    micro_batches_per_step: int
    seconds_per_step: float


MEASURED = (
    MeasuredRun(
        what="SmolLM2-135M + EAGLE-3 (3 TTT steps), 16 rows a step, online, bf16, alone on the GPU",
        source="BENCHMARKS.md, the GPU runs: the shipped head continued on one H200, 12.7 steps/s, 52.9k tokens/s",
        gpu="h200",
        # the counts plan.py makes of both (tests/train/test_throughput.py recounts them)
        work=Work(134_515_008, 30, 576, 49152, 9_808_128, 1, 3, 130, True),
        tokens_per_micro_batch=4165,
        micro_batches_per_step=1,
        seconds_per_step=1 / 12.7,
    ),
    MeasuredRun(
        what="Llama-3.1-8B + EAGLE-3 (4 TTT steps), 8 x A100-80G, 1 row x 4 accumulated per GPU, online",
        source="NeMo AutoModel's EAGLE-3 guide (published): about 2 h per epoch of 200K rows = 6.25K steps; "
        "1,024 tokens a conversation assumed (not published)",
        gpu="a100",
        work=Work(8_030_261_248, 32, 4096, 128256, 424_689_664, 1, 4, 512, True),  # draft vocab 32000
        tokens_per_micro_batch=1024,
        micro_batches_per_step=4,
        seconds_per_step=2 * 3600 / 6250,
    ),
)


@dataclass(frozen=True)
class Fit:
    overhead: float  # seconds per micro-batch
    efficiency: float  # share of the peak


def fit(runs=MEASURED) -> Fit:
    """overhead and efficiency solved from `runs`: each is one equation, linear in (overhead,
    1 / efficiency); least squares on the relative error when there are more than two."""
    rows = []
    for r in runs:
        compute = r.tokens_per_micro_batch * flops_per_token(r.work) / GPUS[r.gpu]
        t = r.seconds_per_step / r.micro_batches_per_step
        rows.append((1 / t, compute / t))  # 1 = overhead / t + (1 / efficiency) compute / t
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    overhead, inverse = (sbb * sa - sab * sb) / det, (saa * sb - sab * sa) / det
    return Fit(overhead=max(0.0, overhead), efficiency=1 / inverse)


FIT = fit()


def tokens_per_second(w: Work, tokens_per_micro_batch: int, gpu: str, model: Fit = FIT) -> float:
    """The model's tokens per second on one GPU of type `gpu`."""
    seconds = model.overhead + tokens_per_micro_batch * flops_per_token(w) / (GPUS[gpu] * model.efficiency)
    return tokens_per_micro_batch / seconds
