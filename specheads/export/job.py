"""The `python -m specheads.export` job: resolve the head and target, export, optionally publish."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from ..config import model_option
from ..config.export import ExportJobConfig
from ..config.model import ModelConfig
from ..errors import SpecHeadsError
from ..target import EMBEDDED_PREFIX, EMBEDDED_TARGETS, TargetInfo, gguf_file_of
from .common import HeadSource
from .exporter import FORMATS, ExportResult, check_servable, export_head, formats_for, is_exported_dir, load_exported
from .hub import push_to_hub, resolve_head_path
from .model_card import model_card, read_bench_summary


def model_config_for_target(name: str, conf_dir: Path | None = None) -> ModelConfig | None:
    """The conf/model option whose `name` is the head's target name (what train.py was run with);
    conf_dir defaults to the configs installed with specheads."""
    found = model_option(name, conf_dir)
    if found is None:
        return None
    data = found[1]
    data.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))


def hub_id_of(model_cfg: ModelConfig | None, info: TargetInfo) -> str:
    """Where engines should load the target from: its Hub id when we know one."""
    if model_cfg is None:
        return info.name
    path = model_cfg.path
    if path.startswith(EMBEDDED_PREFIX):
        key = path[len(EMBEDDED_PREFIX) :]
        return EMBEDDED_TARGETS[key][2] if key in EMBEDDED_TARGETS else path
    return path


def causal_lm_architecture(model_type: str) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if isinstance(name, str) else []


def check_chat(src: HeadSource, model_cfg: ModelConfig | None) -> None:
    """One line on stderr when the target the head is exported for renders chats otherwise (its chat
    template, model.thinking) than the head was trained on: an engine serving it so accepts less.
    A head that records nothing, or a target not known here, is not checked."""
    from ..heads.io import head_chat_mismatch
    from ..target import load_tokenizer

    if model_cfg is None or not (src.config.get("training") or {}).get("chat"):
        return
    try:
        tokenizer = load_tokenizer(model_cfg)
    except SpecHeadsError as err:
        print(f"warning: the head's chat template is not checked: {err}", file=sys.stderr)
        return
    warning = head_chat_mismatch(src.directory, src.config, tokenizer)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def target_loader(model_cfg: ModelConfig, src: HeadSource, device: str):
    def load():
        from ..heads import check_compatible
        from ..target import load_target, resolve_device

        target = load_target(model_cfg, resolve_device(device))
        check_compatible(src.info, target.info)
        return target

    return load


def run_export(cfg: ExportJobConfig, conf_dir: Path | None = None) -> ExportResult:
    """The export job of `python -m specheads.export`, from its typed config.

    Args:
        cfg: the settings (specheads.config.export.ExportJobConfig; keys in docs/configuration.md).
        conf_dir: the config directory whose conf/model options name the target; None = installed.

    Returns:
        The ExportResult of the directory written to `cfg.out` (and pushed with `cfg.push_to_hub`).
    """
    fmt = cfg.format
    if fmt not in FORMATS:
        raise SpecHeadsError(f"unknown format={fmt}; choose from {', '.join(FORMATS)}")
    if cfg.push_to_hub and not cfg.repo_id:
        raise SpecHeadsError("push_to_hub=true needs repo_id=org/name")
    if not cfg.out and not cfg.push_to_hub:
        raise SpecHeadsError("out=DIR is required (or push_to_hub=true repo_id=org/name)")
    single_file = getattr(FORMATS[fmt], "SINGLE_FILE", False)
    if single_file and (cfg.push_to_hub or not cfg.out):
        raise SpecHeadsError(f"format={fmt} writes one file: give out=FILE.{fmt} (push_to_hub uploads directories)")
    src, imported = read_source(cfg)
    try:
        return export_source(cfg, src, conf_dir, fmt, single_file)
    finally:
        if imported is not None:
            shutil.rmtree(imported, ignore_errors=True)


def read_source(cfg: ExportJobConfig) -> tuple[HeadSource, Path | None]:
    """The head to export and the scratch directory to remove after (None): our own head
    directory, or a directory exported for an engine (a head trained elsewhere: speculators'
    trainer, SpecForge) read back onto its target and written as ours, so that every format can
    be written from it."""
    path = resolve_head_path(cfg.head_path)
    if not is_exported_dir(path):
        return HeadSource.read(path), None
    if cfg.model is None:
        raise SpecHeadsError(f"{path} is a head exported for an engine: pass model=NAME (its target) to read it back")
    from ..heads import save_head
    from ..target import load_target, resolve_device

    head = load_exported(path, load_target(cfg.model, resolve_device(cfg.device)))
    scratch = Path(tempfile.mkdtemp(prefix="specheads-import-"))
    save_head(head, scratch / "head", training={"imported_from": str(path)})
    return HeadSource.read(scratch / "head"), scratch


def export_source(cfg: ExportJobConfig, src: HeadSource, conf_dir: Path | None, fmt: str, single_file: bool):
    check_servable(src.family)
    if src.family in getattr(FORMATS[fmt], "REFUSED", {}):
        raise SpecHeadsError(FORMATS[fmt].REFUSED[src.family])
    if src.family not in FORMATS[fmt].FAMILIES:
        raise SpecHeadsError(
            f"format={fmt} does not hold {src.family} heads; use one of {', '.join(formats_for(src.family))}"
        )
    model_cfg = cfg.model if cfg.model is not None else model_config_for_target(src.info.name, conf_dir)
    base_model = cfg.base_model or hub_id_of(model_cfg, src.info)
    check_chat(src, model_cfg)
    bench = read_bench_summary(cfg.bench.summary)

    def readme(source: HeadSource, result: ExportResult) -> str:
        return model_card(
            source,
            fmt,
            result.engines,
            repo_id=cfg.repo_id,
            base_model=base_model,
            bench_summary=bench,
            bench_source=cfg.bench.summary or "",
            num_speculative_tokens=cfg.num_speculative_tokens,
            notes=result.notes,
        )

    scratch = None if cfg.out else Path(tempfile.mkdtemp(prefix="specheads-export-"))
    out = Path(cfg.out) if cfg.out else scratch / "head"
    try:
        result = export_head(
            src,
            fmt,
            out,
            engine=cfg.engine,
            dtype=cfg.dtype,
            embeddings=cfg.embeddings,
            base_model=base_model,
            verifier_architectures=causal_lm_architecture(src.info.model_type),
            num_speculative_tokens=cfg.num_speculative_tokens,
            target=target_loader(model_cfg, src, cfg.device) if model_cfg is not None else None,
            readme=None if single_file else readme,
            target_gguf=gguf_file_of(model_cfg) if single_file and model_cfg is not None else None,
        )
        for engine, problems in result.findings.items():
            status = "ok" if not problems else "not loadable: " + "; ".join(problems[:2])
            print(f"{engine}: {status}")
        for note in result.notes:
            print(f"note: {note}")
        url = None
        if cfg.push_to_hub:
            url = push_to_hub(out, cfg.repo_id, private=cfg.private, commit_message=cfg.commit_message)
            print(f"uploaded to {cfg.repo_id}: {url}")
        print(url if scratch is not None else result.path, flush=True)
        return result
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
