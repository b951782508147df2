"""Weight-only int8 for a draft head's linear layers (infer.py's head_dtype=int8, and auto on a CPU
with native bf16 under an fp32 target).

Drafting runs the head over one to a few rows at a time, right after a target forward has pushed
the head's weights out of the CPU's caches: a draft step costs about the time to stream those
weights from memory. Stored as int8 with one scale per output channel (symmetric, round to
nearest), they stream at half of bf16's bytes; torch's `_weight_int8pack_mm` (ATen's weight-only
int8 matrix product) multiplies bf16 or fp32 activations by them without ever writing the
dequantized weight. Only the head's proposals can change, never the output: the
target verifies every draft in its own precision.

The kernel is used on CPU where the input width is a multiple of 32 (torch 2.13's CPU kernel
crashes on widths such as 8 or 24; the SmolLM2 head's widths, 576 to 1728, are multiples of 32).
Elsewhere a layer multiplies by its dequantized weight, built at each call: the same product,
without the saving.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SpecHeadsError
from .linear_layout import linear_layers

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_WIDTH_MULTIPLE = 32


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], fp32 scales [N]) with weight ~= int8 * scale[:, None].

    The scale maps each row's largest magnitude to 127; an all-zero row gets scale 1.
    """
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def fused_kernel_fits(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.shape[1] % KERNEL_WIDTH_MULTIPLE == 0


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (q * scales)^T (+ bias), in x's dtype; scales must be in x's dtype."""
    if not fused_kernel_fits(q):
        return F.linear(x, dequantize(q, scales).to(x.dtype), bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.aten._weight_int8pack_mm(rows, q, scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], q.shape[0])


def _int8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return int8_linear(x.to(self._int8_scales.dtype), self._int8_weight, self._int8_scales, self.bias)


def install(module: nn.Module) -> int:
    """Run every nn.Linear of `module` on an int8 copy of its weight; returns how many.

    Activations stay in the module's dtype (fp32, bf16 or fp16). The layers keep their own
    weights (what is saved or trained), and the int8 copies are made here, once: the module must
    not be trained while they are installed.
    """
    layers = linear_layers(module)
    for layer in layers:
        dtype = layer.weight.dtype
        if dtype not in ACTIVATION_DTYPES:
            raise SpecHeadsError(f"int8 drafting needs a float32, bfloat16 or float16 head, not {dtype}")
        q, scales = quantize_per_channel(layer.weight)
        layer._int8_weight = q.to(layer.weight.device)
        layer._int8_scales = scales.to(device=layer.weight.device, dtype=dtype)
        layer.forward = types.MethodType(_int8_forward, layer)
    return len(layers)


def installed(module: nn.Module) -> bool:
    return any(hasattr(layer, "_int8_weight") for layer in linear_layers(module))


def uninstall(module: nn.Module) -> None:
    for layer in linear_layers(module):
        if hasattr(layer, "_int8_weight"):
            del layer.forward, layer._int8_weight, layer._int8_scales
