"""vLLM's own config classes read our P-EAGLE exports (marker `engines`: runs in vLLM's virtualenv,
which `make engines` builds; the config classes import without a GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_export import EAGLE3, make_head_dir

from specheads.export import export_head

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

READ_CONFIGS = """
import json, sys
from transformers import AutoConfig
from vllm.transformers_utils.configs.eagle import EAGLEConfig
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
research, speculators = sys.argv[1], sys.argv[2]
eagle = EAGLEConfig(model=AutoConfig.from_pretrained(research), method="eagle3")
spec = SpeculatorsConfig.from_pretrained(speculators)
raw = json.load(open(speculators + "/config.json"))
print(json.dumps({
    "research": {"architectures": eagle.architectures, "mask_token_id": eagle.mask_token_id},
    "speculators": {"architectures": spec.architectures, "pard_token": spec.pard_token,
                    "draft_vocab_size": spec.draft_vocab_size,
                    "serving": SpeculatorsConfig.extract_vllm_speculative_config(raw)},
}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_vllm_config_classes_read_a_parallel_head(tiny_target, tmp_path):
    src = make_head_dir(tiny_target, tmp_path / "head", "peagle", mask_token_id=7, **EAGLE3)
    research = export_head(src, "eagle3", tmp_path / "research", target=tiny_target).path
    speculators = export_head(src, "speculators", tmp_path / "spec", num_speculative_tokens=3, target=tiny_target).path
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", READ_CONFIGS, str(research), str(speculators)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["research"] == {"architectures": ["LlamaForCausalLMEagle3"], "mask_token_id": 7}
    assert seen["speculators"] == {
        "architectures": ["PeagleLlamaForCausalLM"],
        "pard_token": 7,
        "draft_vocab_size": 96,
        "serving": {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True},
    }
