"""Export heads to serving-engine formats and the Hugging Face Hub, and read them back.

    export_head(head_dir, fmt, out_dir, ...) -> ExportResult      one format, validated, atomic
    load_exported(exported_dir, target) -> DraftHead              any format back into specheads
    resolve_head_path(path_or_hub_id) -> Path                     local dir, or snapshot_download
    push_to_hub(folder, repo_id)                                  one create_repo + upload_folder
    check_directory(dir, fmt) -> {engine: problems}               the per-engine contracts

Formats: eagle3 (vLLM, SGLang), speculators (vLLM), eagle (vLLM, SGLang), vllm-medusa (vLLM),
medusa (TensorRT-LLM, TGI). CLI: `python -m specheads.export head=DIR format=F out=DIR`.
"""

from .common import HeadSource
from .exporter import (
    FORMATS, ExportResult, detect_format, export_head, formats_for, is_exported_dir, load_exported,
    read_exported,
)
from .hub import push_to_hub, resolve_head_path
from .model_card import model_card
from .validate import CONTRACTS, check_directory

__all__ = [
    "CONTRACTS", "FORMATS", "ExportResult", "HeadSource", "check_directory", "detect_format", "export_head",
    "formats_for", "is_exported_dir", "load_exported", "model_card", "push_to_hub", "read_exported",
    "resolve_head_path",
]
