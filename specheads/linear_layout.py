"""Which matrix-product layout each of the frozen target's linear layers uses, by row count.

On CPU, `x @ W^T` (nn.Linear) over a handful of rows, the 2-64 query tokens of a tree
verification, runs far below the speed of the 1-row matrix-vector path that plain decoding takes:
a 2-token forward can cost nearly twice a 1-token one. The same product computed as
`(W @ x^T)^T`, the weight as the left operand, is often much faster there. Which layout wins
depends on the machine, the weight's shape and the row count, so it is measured: for each
distinct weight shape and each row count of a ladder, both layouts are timed and the faster one
kept (`measure_layouts`, cached per machine). One row always keeps F.linear: plain decoding is
untouched.

Both layouts compute the same sums in a different order, so results differ by float rounding,
as an N-row GEMM already does from the 1-row GEMV. Greedy outputs stay the target's own
(tests/test_linear_layout.py checks speculative greedy decoding under both against the target's
plain greedy decoding).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import platform
import time
import types
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .atomic import write_json
from .target import cache_root

LAYOUT_VERSION = 1
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
    """The row counts (of the ladder) at which one weight shape runs faster weight-left."""

    def __init__(self, weight_left_rungs: Iterable[int]):
        self.rungs = frozenset(weight_left_rungs)

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


def install(model: nn.Module, layouts: dict[tuple[int, int], RowLayouts]) -> int:
    """Route each nn.Linear of `model` by row count; returns how many layers got a layout."""
    count = 0
    for layer in linear_layers(model):
        chosen = layouts.get(tuple(layer.weight.shape))
        if chosen is None or not chosen.rungs:
            continue
        layer._row_layouts = chosen
        layer.forward = types.MethodType(_layout_forward, layer)
        count += 1
    return count


def uninstall(model: nn.Module) -> None:
    for layer in linear_layers(model):
        if "forward" in layer.__dict__:
            del layer.forward
            del layer._row_layouts


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def time_shape(weight: torch.Tensor, rows: int, repeats: int = 5) -> tuple[float, float]:
    """(seconds with F.linear, seconds weight-left) for `rows` rows through `weight`."""
    x = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    stock = _time(lambda: F.linear(x, weight), repeats)
    left = _time(lambda: weight_left_linear(x, weight, None), repeats)
    return stock, left


def choose(
    weight: torch.Tensor, ladder: Sequence[int] = ROW_LADDER, repeats: int = 5, margin: float = 0.95
) -> RowLayouts:
    """The rungs where weight-left beats F.linear by at least 1 - margin (noise stays stock)."""
    faster = []
    for rows in ladder:
        stock, left = time_shape(weight, rows, repeats)
        if left < margin * stock:
            faster.append(rows)
    return RowLayouts(faster)


def machine_key(model: nn.Module) -> str:
    shapes = sorted({(tuple(m.weight.shape), str(m.weight.dtype)) for m in linear_layers(model)})
    parts = {
        "version": LAYOUT_VERSION,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": platform.processor() or _cpu_model(),
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


def measure_layouts(model: nn.Module, repeats: int = 5, cache: bool = True) -> dict[tuple[int, int], RowLayouts]:
    """Per weight shape, the rungs that run faster weight-left on this machine (cached on disk)."""
    path = cache_root() / "linear_layouts" / f"{machine_key(model)}.json"
    if cache and path.is_file():
        stored = json.loads(path.read_text())
        return {tuple(s["shape"]): RowLayouts(s["weight_left_rows"]) for s in stored["shapes"]}
    weights = {}
    for layer in linear_layers(model):
        weights.setdefault(tuple(layer.weight.shape), layer.weight)
    layouts = {shape: choose(w, repeats=repeats) for shape, w in weights.items()}
    if cache:
        write_json(
            path,
            {"shapes": [{"shape": list(s), "weight_left_rows": sorted(r.rungs)} for s, r in layouts.items()]},
        )
    return layouts


def describe(layouts: dict[tuple[int, int], RowLayouts]) -> str:
    parts = [f"{s[0]}x{s[1]}: {','.join(map(str, sorted(r.rungs))) or '-'}" for s, r in sorted(layouts.items())]
    return "weight-left rows per linear shape (" + "; ".join(parts) + ")"
