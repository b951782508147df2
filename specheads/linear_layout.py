"""Which matrix-product layout the frozen target's linear layers use, by the number of rows.

On CPU, `x @ W^T` (nn.Linear) over a handful of rows, the 2-64 query tokens of a tree
verification, can run far below the speed of the 1-row matrix-vector path that plain decoding
takes: a 2-token forward may cost 1.6x a 1-token one. The same product computed as `(W @ x^T)^T`,
the weight as the left operand, can be much faster there. Which layout wins depends on the
machine and the row count, and isolated matrix products do not predict it (in a whole forward the
weights stream from memory), so whole verification forwards are timed: for each row count of a
ladder, the target's forward of that many query tokens after a KV-cached context, stock and
weight-left interleaved, and the faster layout kept (`measure_layouts`, cached per machine). One
row always keeps F.linear: plain decoding is untouched.

Both layouts compute the same sums in a different order, so results differ by float rounding, as
an N-row GEMM already does from the 1-row GEMV. Greedy outputs stay the target's own
(tests/decode/test_generate.py checks speculative greedy decoding under the weight-left layout
against the target's plain greedy decoding, on the tiny target and on SmolLM2).
"""

from __future__ import annotations

import bisect
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

from .atomic import write_json
from .target import cache_root

LAYOUT_VERSION = 2
# Row counts timed; a count between two rungs takes the decision of the next rung up.
ROW_LADDER = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def weight_left_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T."""
    rows = x.reshape(-1, x.shape[-1])
    out = (weight @ rows.T).T
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RowLayouts:
    """The row counts (rungs of the ladder) at which the linear layers run weight-left."""

    def __init__(self, weight_left_rungs=()):
        self.rungs = frozenset(weight_left_rungs)
        self.timings: dict[int, tuple[float, float]] = {}  # rung -> (stock s, weight-left s), measured

    def weight_left(self, rows: int) -> bool:
        if rows < 2 or rows > ROW_LADDER[-1]:
            return False
        return ROW_LADDER[bisect.bisect_left(ROW_LADDER, rows)] in self.rungs


def _layout_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self._row_layouts.weight_left(x.numel() // x.shape[-1]):
        return weight_left_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def install(model: nn.Module, layouts: RowLayouts) -> int:
    """Route every nn.Linear of `model` by row count; returns how many layers were routed."""
    layers = linear_layers(model)
    for layer in layers:
        layer._row_layouts = layouts
        layer.forward = types.MethodType(_layout_forward, layer)
    return len(layers)


def uninstall(model: nn.Module) -> None:
    for layer in linear_layers(model):
        if "forward" in layer.__dict__:
            del layer.forward
            del layer._row_layouts


@torch.no_grad()
def time_forwards(model: nn.Module, rows: int, context: int = 128, repeats: int = 5) -> tuple[float, float]:
    """(stock, weight-left) median seconds of a forward of `rows` query tokens after a cached
    context of `context` tokens, the two layouts interleaved so that drift hits both alike."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + rows), generator=g).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
    probe = RowLayouts()
    install(model, probe)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(repeats + 1):
            for left in (False, True):
                probe.rungs = frozenset(ROW_LADDER if left else ())
                t0 = time.perf_counter()
                model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True)
                if r:  # the first round warms up
                    times[left].append(time.perf_counter() - t0)
                cache.crop(-rows)
    finally:
        uninstall(model)
    return statistics.median(times[False]), statistics.median(times[True])


def choose(model: nn.Module, ladder=ROW_LADDER, repeats: int = 5, margin: float = 0.95) -> RowLayouts:
    """The rungs where weight-left forwards beat stock ones by at least 1 - margin (noise stays
    stock)."""
    chosen = RowLayouts()
    faster = []
    for rows in tqdm(ladder, desc="timing linear layouts", unit="rows", leave=False):
        stock, left = time_forwards(model, rows, repeats=repeats)
        chosen.timings[rows] = (stock, left)
        if left < margin * stock:
            faster.append(rows)
    chosen.rungs = frozenset(faster)
    return chosen


def machine_key(model: nn.Module) -> str:
    shapes = sorted({(tuple(m.weight.shape), str(m.weight.dtype)) for m in linear_layers(model)})
    parts = {
        "version": LAYOUT_VERSION,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": platform.processor() or _cpu_model(),
        "model": getattr(model.config, "model_type", ""),
        "layers": getattr(model.config, "num_hidden_layers", 0),
        "shapes": shapes,
        "ladder": ROW_LADDER,
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def measure_layouts(model: nn.Module, repeats: int = 5, cache: bool = True) -> RowLayouts:
    """The rungs that run faster weight-left on this machine (timed once, then read from disk)."""
    path = cache_root() / "linear_layouts" / f"{machine_key(model)}.json"
    if cache and path.is_file():
        stored = json.loads(path.read_text())
        layouts = RowLayouts(stored["weight_left_rows"])
        layouts.timings = {int(k): tuple(v) for k, v in stored.get("timings", {}).items()}
        return layouts
    layouts = choose(model, repeats=repeats)
    if cache:
        timings = {str(k): list(v) for k, v in layouts.timings.items()}
        write_json(path, {"weight_left_rows": sorted(layouts.rungs), "timings": timings})
    return layouts


def describe(layouts: RowLayouts) -> str:
    rungs = ",".join(map(str, sorted(layouts.rungs))) or "none"
    ratio = " ".join(f"{k}:{left / stock:.2f}" for k, (stock, left) in sorted(layouts.timings.items()) if stock)
    return f"linear layout: weight-left for {rungs} rows" + (
        f" (weight-left / stock time per rows: {ratio})" if ratio else ""
    )
