"""When two float computations of the same numbers count as equal: the one rule the product's own
checks use (a made draft model against the target's first layers, packed against unpacked states)
and the tests hold it to.

The error is the largest elementwise difference relative to the reference's magnitude (its largest
absolute value), not elementwise: a logit of 0.01 beside logits of 8 carries the summation error of
its neighbours, so an elementwise relative tolerance fails on the machine whose kernels sum in
another order. In fp32 another order (another CPU's kernels, a batched against a one-token path)
moves results by about 1e-6 of the magnitude; a wrong computation (a layer off, a position off, a
norm left out) by far more than TOLERANCE[torch.float32].
"""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (inf for another shape or a non-finite value)."""
    if actual.shape != expected.shape:
        return float("inf")
    a, b = actual.detach().double(), expected.detach().double()
    error = float((a - b).abs().max()) if b.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    if error != error or error == float("inf"):  # NaN or inf
        return float("inf")
    return error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))


def same_numbers(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether `actual` equals `expected` within the tolerance of `dtype` (the lower precision of
    the two by default)."""
    if dtype is None:
        floats = [t.dtype for t in (actual, expected) if t.dtype in TOLERANCE] or [torch.float32]
        dtype = max(floats, key=lambda d: torch.finfo(d).eps)
    return relative_error(actual, expected) <= TOLERANCE[dtype]
