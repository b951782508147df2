"""Which kernel the frozen target's linear layers use, by the number of rows.

On CPU, `x @ W^T` (nn.Linear) over a handful of rows, the 2-64 query tokens of a tree
verification, can run far below the speed of the 1-row matrix-vector path that plain decoding
takes: a 2-token forward may cost 1.6x a 1-token one. Two other kernels compute the same product:
  weight-left  `(W @ x^T)^T`, the weight as the left operand of the matrix product;
  packed       oneDNN's linear over a copy of the weight reordered once into its blocked layout
               (the kernel torch.compile's CPU freezing pass uses); it streams the weight faster at
               every row count, one row included, at the price of that copy in memory.
Which kernel wins depends on the machine and the row count, and isolated matrix products do not
predict it (in a whole forward the weights stream from memory), so whole forwards are timed: for
each row count of a ladder, the target's forward of that many query tokens after a KV-cached
context, every kernel interleaved, and the fastest kept when it beats stock by a margin
(`measure_layouts`, cached per machine). Row counts above the ladder (prefill) stay stock.

The kernels compute the same sums in a different order, so results differ by float rounding, as
an N-row GEMM already does from the 1-row GEMV. Greedy outputs stay the target's own
(tests/decode/test_generate.py checks speculative greedy decoding under each kernel against the
target's greedy decoding as transformers ships it, on the tiny target and on SmolLM2). The HF
baselines run with the kernels suspended (`stock_kernels`): they measure transformers as shipped,
and this package's own plain decoding shows what the kernels alone are worth.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import hashlib
import json
import platform
import statistics
import time
import types

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..atomic import write_json
from ..target import cache_root

LAYOUT_VERSION = 3
# Row counts timed; a count between two rungs takes the decision of the next rung up.
ROW_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STOCK, WEIGHT_LEFT, PACKED = "stock", "weight-left", "packed"
KERNELS = (STOCK, WEIGHT_LEFT, PACKED)


def weight_left_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T."""
    rows = x.reshape(-1, x.shape[-1])
    # contiguous, as F.linear's result is: llama4's RoPE views the query's last dim as complex pairs
    out = (weight @ rows.T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered into oneDNN's blocked layout (a copy; the layer keeps its own)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class RowLayouts:
    """The kernel chosen for each rung of the ladder (stock where none is named)."""

    def __init__(self, kernels: dict[int, str] | None = None):
        self.kernels = {int(k): v for k, v in (kernels or {}).items() if v != STOCK}
        bad = set(self.kernels.values()) - set(KERNELS)
        if bad:
            raise ValueError(f"unknown linear kernel(s) {sorted(bad)}; known: {KERNELS}")
        self.timings: dict[int, dict[str, float]] = {}  # rung -> kernel -> median s, measured

    @classmethod
    def everywhere(cls, kernel: str) -> RowLayouts:
        return cls({r: kernel for r in ROW_LADDER})

    def kernel(self, rows: int) -> str:
        if rows < 1 or rows > ROW_LADDER[-1]:
            return STOCK
        return self.kernels.get(ROW_LADDER[bisect.bisect_left(ROW_LADDER, rows)], STOCK)

    def uses(self, kernel: str) -> bool:
        return kernel in self.kernels.values()


def _layout_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    kernel = self._row_layouts.kernel(x.numel() // x.shape[-1])
    if kernel == PACKED and self._packed_weight is not None:
        return packed_linear(x, self._packed_weight, self.bias)
    if kernel == WEIGHT_LEFT:
        return weight_left_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The layers that compute nn.Linear's product: a subclass with a forward of its own (llama4's
    router returns its routing scores too) is left as it is."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward]


def install(model: nn.Module, layouts: RowLayouts) -> int:
    """Route every nn.Linear of `model` by row count; returns how many layers were routed.

    The packed copies are made here, once (a layer whose weight cannot be packed stays stock
    where packed was chosen); the model must not be trained while they are installed.
    """
    layers = linear_layers(model)
    for layer in layers:
        layer._row_layouts = layouts
        packed = layouts.uses(PACKED) and packing_available(layer.weight)
        if not packed:
            layer._packed_weight = None
        elif getattr(layer, "_packed_weight", None) is None:
            layer._packed_weight = pack_weight(layer.weight)
        layer.forward = types.MethodType(_layout_forward, layer)
    return len(layers)


def uninstall(model: nn.Module) -> None:
    for layer in linear_layers(model):
        if "forward" in layer.__dict__:
            del layer.forward
            del layer._row_layouts
            del layer._packed_weight


@contextlib.contextmanager
def stock_kernels(model: nn.Module):
    """Within the block every routed layer of `model` runs nn.Linear (its packed copy is kept)."""
    routed = [layer for layer in linear_layers(model) if "forward" in layer.__dict__]
    saved = [layer._row_layouts for layer in routed]
    stock = RowLayouts()
    for layer in routed:
        layer._row_layouts = stock
    try:
        yield
    finally:
        for layer, layouts in zip(routed, saved):
            layer._row_layouts = layouts


def candidate_kernels(model: nn.Module) -> tuple[str, ...]:
    weight = next(model.parameters())
    return KERNELS if packing_available(weight) else (STOCK, WEIGHT_LEFT)


@torch.no_grad()
def time_forwards(
    model: nn.Module, rows: int, kernels: tuple[str, ...] = KERNELS, context: int = 128, repeats: int = 5
) -> dict[str, float]:
    """Median seconds per kernel of a forward of `rows` query tokens after a cached context of
    `context` tokens, the kernels interleaved so that drift hits them alike."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + rows), generator=g).to(device)
    prefilled = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], cache=prefilled, use_cache=True, logits_to_keep=1)
    probe = RowLayouts.everywhere(PACKED) if PACKED in kernels else RowLayouts()
    install(model, probe)  # makes the packed copies once
    times: dict[str, list[float]] = {k: [] for k in kernels}
    try:
        for r in range(repeats + 1):
            for kernel in kernels:
                probe.kernels = {rung: kernel for rung in ROW_LADDER}
                # a copy per forward, made before the clock starts: the forward appends to it (or
                # folds into a recurrent state) in place, and a sliding-window, linear-attention or
                # Mamba layer cannot be cropped back to the context
                cache = copy.deepcopy(prefilled)
                t0 = time.perf_counter()
                model(input_ids=ids[:, context:], cache=cache, use_cache=True)
                if r:  # the first round warms up
                    times[kernel].append(time.perf_counter() - t0)
    finally:
        uninstall(model)
    return {k: statistics.median(v) for k, v in times.items()}


def choose(model: nn.Module, ladder=ROW_LADDER, repeats: int = 5, margin: float = 0.95) -> RowLayouts:
    """Per rung, the fastest kernel if it beats stock by at least 1 - margin (noise stays stock)."""
    chosen = RowLayouts()
    kernels = candidate_kernels(model)
    for rows in tqdm(ladder, desc="timing linear kernels", unit="rows", leave=False):
        timings = time_forwards(model, rows, kernels, repeats=repeats)
        chosen.timings[rows] = timings
        best = min(timings, key=timings.get)
        if best != STOCK and timings[best] < margin * timings[STOCK]:
            chosen.kernels[rows] = best
    return chosen


def machine_key(model: nn.Module) -> str:
    shapes = sorted({(tuple(m.weight.shape), str(m.weight.dtype)) for m in linear_layers(model)})
    parts = {
        "version": LAYOUT_VERSION,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": platform.processor() or cpu_model(),
        "model": getattr(model.config, "model_type", ""),
        "layers": getattr(model.config, "num_hidden_layers", 0),
        "shapes": shapes,
        "ladder": ROW_LADDER,
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo ("" where there is none)."""
    return _cpuinfo_field("model name")


# the instruction sets that decide which matmul kernels torch's CPU build runs: two processors of one
# model name (a cloud's "Intel Xeon Processor") may differ in them, and so in every timing
KERNEL_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_isa() -> list[str]:
    """Which of KERNEL_ISA the processor has, from /proc/cpuinfo's flags ([] where there are none)."""
    flags = set(_cpuinfo_field("flags").split())
    return [f for f in KERNEL_ISA if f in flags]


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def measure_layouts(model: nn.Module, repeats: int = 5, cache: bool = True) -> RowLayouts:
    """The kernel per rung that runs fastest on this machine (timed once, then read from disk)."""
    path = cache_root() / "linear_layouts" / f"{machine_key(model)}.json"
    if cache and path.is_file():
        stored = json.loads(path.read_text())
        layouts = RowLayouts(stored["kernels"])
        layouts.timings = {int(k): dict(v) for k, v in stored.get("timings", {}).items()}
        return layouts
    layouts = choose(model, repeats=repeats)
    if cache:
        write_json(
            path,
            {
                "kernels": {str(k): v for k, v in sorted(layouts.kernels.items())},
                "timings": {str(k): v for k, v in layouts.timings.items()},
            },
        )
    return layouts


def describe(layouts: RowLayouts) -> str:
    chosen = " ".join(f"{r}:{k}" for r, k in sorted(layouts.kernels.items())) or "stock everywhere"
    ratios = []
    for rows, timings in sorted(layouts.timings.items()):
        stock = timings.get(STOCK)
        if stock:
            others = ",".join(f"{k[0]}{t / stock:.2f}" for k, t in timings.items() if k != STOCK)
            ratios.append(f"{rows}:{others}")
    text = f"linear kernels by rows: {chosen}"
    if ratios:
        text += " (time / stock, w = weight-left, p = packed: " + " ".join(ratios) + ")"
    return text
