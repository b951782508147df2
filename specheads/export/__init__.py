"""Export heads to serving-engine formats and the Hugging Face Hub, and read them back.

    export_head(head_dir, fmt, out_dir, ...) -> ExportResult      one format, validated, atomic
    load_exported(exported_dir, target) -> DraftHead              any format back into specheads
    open_head(dir_or_hub_id, target) -> DraftHead                 a head dir, Hub id or engine export
    resolve_head_path(path_or_hub_id) -> Path                     local dir, or snapshot_download
    push_to_hub(folder, repo_id)                                  one create_repo + upload_folder
    check_directory(dir, fmt) -> {engine: problems}               the per-engine contracts
    source_head_config(exported_dir) -> dict | None               the specheads config it came from

Formats: eagle3 (vLLM, SGLang), speculators (vLLM), eagle (vLLM, SGLang), vllm-medusa (vLLM),
medusa (TensorRT-LLM, TGI), gguf (llama.cpp: one file). CLI: `python -m specheads.export head=DIR
format=F out=DIR` (gguf: out=FILE.gguf).
Names are imported on first use, so `specheads.config.export` stays cheap to import.
"""

from importlib import import_module

_EXPORTS = {
    "HeadSource": "common",
    "FORMATS": "exporter",
    "ExportResult": "exporter",
    "detect_format": "exporter",
    "export_head": "exporter",
    "formats_for": "exporter",
    "is_exported_dir": "exporter",
    "load_exported": "exporter",
    "read_exported": "exporter",
    "source_head_config": "exporter",
    "push_to_hub": "hub",
    "resolve_head_path": "hub",
    "model_card": "model_card",
    "open_head": "load",
    "CONTRACTS": "validate",
    "check_directory": "validate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
