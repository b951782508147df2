"""What vLLM's CPU build computes in the ops our drafters depend on (marker `engines`: runs in
vLLM's virtualenv, which `make engines` builds).

DFlash: vLLM normalises the context keys of every draft layer with ONE `ops.rms_norm` call and
the layers' k_norm weights stacked as [L, head_dim] (qwen3_dflash.py, _normalize_context_k). The
0.32 CPU kernel reads one weight vector: every layer gets layer 0's k_norm, so a DFlash draft with
per-layer k_norm weights would be served wrongly, silently, on CPUs. A head meant for vLLM's CPU
build ties its k_norm weights across layers. This test pins that behaviour: when it fails, the
CPU kernel has learned per-layer weights and the tie is no longer needed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

STACKED_RMS_NORM = """
import json, torch
from vllm import _custom_ops as ops
x = torch.randn(2, 3, 2, 64, generator=torch.Generator().manual_seed(0))
w = torch.stack([torch.full((64,), 1.0), torch.full((64,), 3.0)])
out = torch.empty_like(x)
ops.rms_norm(out, x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
print(json.dumps({
    "per_layer": torch.allclose(out, torch.stack([ref[0] * w[0], ref[1] * w[1]]), atol=1e-4),
    "layer_0_for_all": torch.allclose(out, ref * w[0], atol=1e-4),
}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_cpu_rms_norm_applies_layer_0s_weight_to_every_layer():
    proc = subprocess.run([str(VLLM_PYTHON), "-c", STACKED_RMS_NORM], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"per_layer": False, "layer_0_for_all": True}
