"""vLLM's own config classes read our P-EAGLE and DFlash exports (marker `engines`: runs in vLLM's virtualenv,
which `make engines` builds; the config classes import without a GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_export import EAGLE3, make_head_dir

from specheads.export import export_head

pytestmark = pytest.mark.usefixtures("one_thread")

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


READ_DFLASH = """
import json, sys, types
from transformers import AutoConfig
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention, dflash_has_any_non_causal
from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS
from vllm.transformers_utils.configs.eagle import EAGLEConfig
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
cfg = EAGLEConfig(AutoConfig.from_pretrained(sys.argv[1]), method="dflash", model_type="eagle")
spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=cfg))
print(json.dumps({
    "architectures": cfg.architectures,
    "class": list(_SPECULATIVE_DECODING_MODELS[cfg.architectures[0]]),
    "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec)),
    "mask_token_id": cfg.dflash_config["mask_token_id"],
    "non_causal": dflash_has_any_non_causal(cfg),
    "layers": [list(_resolve_layer_attention(cfg, i)) for i in range(cfg.num_hidden_layers)],
    "sizes": [cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size],
    "rope": cfg.rope_parameters,
}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_vllm_config_classes_read_a_dflash_head(tiny_target, tmp_path):
    """vLLM wraps the draft's config as EAGLEConfig(method=dflash): our export resolves to its DFlash
    model, captures our layer ids, and runs every layer non-causally without sliding windows."""
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash", dflash_layers=3, mask_token_id=7)
    assert json.loads((src / "config.json").read_text())["layer_ids"] == [2, 3, 4]
    out = export_head(src, "dflash", tmp_path / "out").path
    proc = subprocess.run([str(VLLM_PYTHON), "-c", READ_DFLASH, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    info = tiny_target.info
    assert seen == {
        "architectures": ["DFlashDraftModel"],
        "class": ["qwen3_dflash", "DFlashQwen3ForCausalLM"],
        "aux_layer_ids": [2, 3, 4],  # the head's own ids (our numbering): vLLM adds 1 to target_layer_ids
        "mask_token_id": 7,
        "non_causal": True,
        "layers": [[None, False]] * 3,  # (sliding window, causal) per draft layer
        "sizes": [info.hidden_size, info.num_attention_heads, info.num_key_value_heads, info.head_dim, 128],
        "rope": {"rope_theta": 10000.0, "rope_type": "default"},
    }


READ_SPECULATORS_DFLASH = """
import json, sys, types
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention, dflash_has_any_non_causal
from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS
from vllm.transformers_utils.config import get_config
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
cfg = get_config(sys.argv[1], trust_remote_code=False)
spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=cfg))
raw = json.load(open(sys.argv[1] + "/config.json"))
print(json.dumps({
    "config": type(cfg).__name__,
    "architectures": cfg.architectures,
    "class": list(_SPECULATIVE_DECODING_MODELS[cfg.architectures[0]]),
    "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec)),
    "dflash_config": cfg.dflash_config,
    "non_causal": dflash_has_any_non_causal(cfg),
    "layers": [list(_resolve_layer_attention(cfg, i)) for i in range(cfg.num_hidden_layers)],
    "serving": SpeculatorsConfig.extract_vllm_speculative_config(raw),
}))
"""


@pytest.mark.engines
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's virtualenv .venv-vllm is absent (make engines builds it)")
def test_vllm_config_classes_read_a_speculators_dflash_head(tiny_target, tmp_path):
    """vLLM reads our speculators DFlash export as SpeculatorsConfig (no EAGLEConfig wrapper) into
    the same DFlash settings as the native format: its model, our layer ids, every layer non-causal."""
    src = make_head_dir(tiny_target, tmp_path / "head", "dflash", dflash_layers=3, mask_token_id=7, block_size=4)
    out = export_head(src, "speculators", tmp_path / "out").path
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", READ_SPECULATORS_DFLASH, str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "config": "SpeculatorsConfig",
        "architectures": ["DFlashDraftModel"],
        "class": ["qwen3_dflash", "DFlashQwen3ForCausalLM"],
        "aux_layer_ids": [2, 3, 4],
        "dflash_config": {
            "mask_token_id": 7,
            "target_layer_ids": [1, 2, 3],  # vLLM's aux ids - 1
            "sample_from_anchor": False,
            "causal": False,
        },
        "non_causal": True,
        "layers": [[None, False]] * 3,
        "serving": {"method": "dflash", "num_speculative_tokens": 3},
    }
