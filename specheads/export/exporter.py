"""Export a specheads head directory to a serving-engine format, and read any of them back.

    export_head(head_dir, "eagle3", out_dir) -> ExportResult
    load_exported(exported_dir, target) -> DraftHead

Every export is checked before it is renamed into place: against each engine's contract
(validate.py), and by reading it back from the engine fields alone (without our provenance block)
and comparing every tensor with the source head, so a directory that would load wrongly is never
left behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .. import atomic
from ..errors import SpecHeadsError
from ..heads.io import CONFIG_NAME
from ..heads.spec import HeadSpec
from . import dflash, eagle, eagle3, gguf, medusa, speculators, validate, validate_gguf, vllm_medusa
from .common import (
    PROVENANCE_KEY,
    ExportOptions,
    HeadSource,
    ReadBack,
    TargetParts,
    cast,
    read_json,
    resolve_export_dtype,
    with_draft_fields,
    write_directory,
)

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (eagle3, speculators, dflash, eagle, vllm_medusa, medusa, gguf)}
# Detection order of the directory formats: the most specific config markers first.
DETECT_ORDER = ("speculators", "eagle3", "dflash", "vllm-medusa", "medusa", "eagle")


@dataclass
class ExportResult:
    path: Path
    format: str
    engines: list[str]  # engines the directory was written and checked for
    findings: dict[str, list[str]]  # every engine of the format: [] or its problems
    notes: list[str] = field(default_factory=list)


def formats_for(family: str) -> list[str]:
    return [name for name, m in FORMATS.items() if family in m.FAMILIES]


def check_servable(family: str) -> None:
    """Refuse, in one line, a head family that no engine format holds (Hydra: no engine loads one)."""
    if formats_for(family):
        return
    from ..heads import HEADS

    title = HEADS[family].title if family in HEADS else family
    served = sorted({f for m in FORMATS.values() for f in m.FAMILIES})
    raise SpecHeadsError(
        f"no serving-engine format serves {title} heads (the formats hold {', '.join(served)} heads); "
        f"a {family} head drafts with infer.py only"
    )


def export_head(
    head: str | os.PathLike | HeadSource,
    fmt: str,
    out: str | os.PathLike,
    *,
    engine: str = "auto",
    dtype: str = "auto",
    embeddings: bool | None = None,
    base_model: str | None = None,
    verifier_architectures: list[str] | None = None,
    num_speculative_tokens: int | None = None,
    target: Any = None,
    readme: Callable[[HeadSource, ExportResult], str] | None = None,
    target_gguf: str | os.PathLike | None = None,
) -> ExportResult:
    """Write `head` in format `fmt` to `out` (atomically), checked against each engine's loader.

    Args:
        head: a head directory (or an already read HeadSource).
        fmt: eagle3 | speculators | dflash | eagle | vllm-medusa | medusa | gguf (docs/serving.md
            says which engine loads which).
        out: the output directory, replaced whole (gguf: the output file).
        engine: auto (every engine of the format that can load this head) or one engine.
        dtype: auto keeps the head's dtype; bfloat16 / float16 halve the files.
        embeddings, base_model, verifier_architectures, num_speculative_tokens: what the format
            stores about the target and the draft length (None: the format's defaults).
        target: a FrozenTarget or a callable returning one, needed only when the format stores
            copies of the target's embedding, LM head or tokenizer.
        target_gguf: the target's own GGUF file, when it is one (gguf copies its vocabulary).
        readme: `readme(src, result)` may return a README.md (model card) written into `out`.

    Returns:
        An ExportResult: the path, the format, the engines checked and each engine's findings.
    """
    src = head if isinstance(head, HeadSource) else HeadSource.read(head)
    if fmt not in FORMATS:
        raise SpecHeadsError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    module = FORMATS[fmt]
    check_servable(src.family)
    if src.family in getattr(module, "REFUSED", {}):
        raise SpecHeadsError(module.REFUSED[src.family])
    if src.family not in module.FAMILIES:
        raise SpecHeadsError(
            f"format {fmt} holds {'/'.join(module.FAMILIES)} heads; this is a {src.family} "
            f"head (its formats: {', '.join(formats_for(src.family))})"
        )
    parts = TargetParts(
        load=(target if callable(target) else (lambda: target)) if target is not None else None,
        gguf_file=Path(target_gguf) if target_gguf is not None else None,
    )
    opts = ExportOptions(
        engine=engine,
        dtype=dtype,
        embeddings=embeddings,
        base_model=base_model,
        verifier_architectures=verifier_architectures,
        num_speculative_tokens=num_speculative_tokens,
        target=parts,
    )
    if getattr(module, "SINGLE_FILE", False):
        return export_file(module, src, opts, Path(out))
    exported = module.build(src, opts)
    required = exported.engines if engine == "auto" else [engine]
    if engine != "auto" and engine not in exported.engines:
        raise SpecHeadsError(
            f"this head cannot be exported for {engine} in format {fmt}: "
            + ("; ".join(exported.notes) or f"it is written for {', '.join(exported.engines)}")
        )
    result = ExportResult(Path(out), fmt, list(exported.engines), {}, list(exported.notes))
    expected = cast(src.tensors, resolve_export_dtype(dtype, src.tensors))

    def check(tmp: Path) -> None:
        findings = validate.require(tmp, fmt, required)
        for name, problems in findings.items():
            if not problems and name not in exported.engines:  # loadable, but not written for it
                problems.append(
                    "written for "
                    + ", ".join(exported.engines)
                    + (f" ({'; '.join(exported.notes)})" if exported.notes else "")
                )
        result.findings = findings
        self_check(module, tmp, src, expected)

    extra = {}
    if readme is not None:
        extra["README.md"] = readme(src, result)
    write_directory(Path(out), exported, extra, check)
    return result


def export_file(module: ModuleType, src: HeadSource, opts: ExportOptions, out: Path) -> ExportResult:
    """A one-file format (gguf): written beside `out`, checked against its engine's loader and read
    back from its engine fields alone, then renamed into place; a failed check leaves nothing."""
    if out.is_dir():
        raise SpecHeadsError(f"out={out} is a directory; format {module.NAME} writes one file (e.g. out=draft.gguf)")
    draft = module.build(src, opts)
    result = ExportResult(out, module.NAME, list(draft.engines), {}, list(draft.notes))
    expected = cast(src.tensors, resolve_export_dtype(opts.dtype, src.tensors))
    with atomic.atomic_path(out) as tmp:
        module.write(draft, tmp)
        result.findings = validate_gguf.require(tmp)
        same_as_source(module.read_file(tmp), src, expected)
    return result


def self_check(module: ModuleType, directory: Path, src: HeadSource, expected: dict[str, torch.Tensor]) -> None:
    """Read the written directory back from its engine fields only; it must give the source head."""
    config = {k: v for k, v in read_json(directory / CONFIG_NAME).items() if k != PROVENANCE_KEY}
    same_as_source(module.read(directory, config, src.info.num_layers), src, expected)


def same_as_source(back: ReadBack, src: HeadSource, expected: dict[str, torch.Tensor]) -> None:
    spec = src.spec
    for key, value in back.spec.items():
        mine = src.layer_ids if key == "layer_ids" else getattr(spec, key)
        if key == "shared_lm_head":
            continue  # per-head copies of a shared LM head read back as separate heads
        if mine != value:
            raise RuntimeError(f"export self-check: {key} reads back as {value!r}, the head has {mine!r}")
    for name, tensor in expected.items():
        got = back.tensors.get(name)
        if got is None or got.shape != tensor.shape or not torch.equal(got, tensor):
            raise RuntimeError(f"export self-check: tensor {name} does not read back unchanged")


# -- reading exported formats back --------------------------------------------------------------------


def detect_format(config: dict[str, Any], directory: Path) -> str | None:
    block = config.get(PROVENANCE_KEY)
    if isinstance(block, dict) and block.get("format") in FORMATS:
        return block["format"]
    for name in DETECT_ORDER:
        if FORMATS[name].detect(config, directory):
            return name
    return None


def read_exported(directory: str | os.PathLike, num_layers: int, numbering: str | None = None) -> ReadBack:
    """An exported directory in our own terms (spec fields, state-dict names); no target needed."""
    directory = Path(directory)
    config = read_json(directory / CONFIG_NAME)
    fmt = detect_format(config, directory)
    if fmt is None:
        raise SpecHeadsError(
            f"{directory} is neither a specheads head nor a known engine format ({', '.join(FORMATS)})"
        )
    return FORMATS[fmt].read(directory, config, num_layers, numbering)


def load_exported(directory: str | os.PathLike, target, numbering: str | None = None):
    """A DraftHead on `target` from any exported format (vLLM, SGLang, speculators, Medusa layouts).

    numbering: how to read explicit EAGLE-3 aux-layer ids of a checkpoint we did not write
    ("vllm": entering layer k, "sglang": output of layer k); see eagle3.our_layer_ids.
    """
    from ..heads import HEADS

    directory = Path(directory)
    back = read_exported(directory, target.info.num_layers, numbering)
    config = read_json(directory / CONFIG_NAME)
    hidden = hidden_size_of(config)
    if hidden is not None and hidden != target.info.hidden_size:
        raise SpecHeadsError(
            f"{directory} is a head for hidden size {hidden}, the target has {target.info.hidden_size}"
        )
    source = back.provenance.get("head_config") or {}
    base = dict(source.get("head") or {}) if source.get("family") == back.family else {}
    spec = HeadSpec.from_dict({**base, **back.spec})
    info = with_draft_fields(target.info, back.draft_fields)
    tensors = HEADS[back.family].adopt_exported(spec, dict(back.tensors), target)
    spec.validate(info)
    head = HEADS[back.family](spec, info)
    head.attach(target)
    try:
        missing, unexpected = head.load_state_dict(tensors, strict=False)
    except RuntimeError as err:
        raise SpecHeadsError(f"{directory} does not fit this target: {str(err).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise SpecHeadsError(
            f"{directory} does not match a {back.family} head: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    head.default_tree = source.get("default_tree")
    return head.to(device=target.device, dtype=target.dtype).eval()


def hidden_size_of(config: dict[str, Any]) -> int | None:
    layer = config.get("transformer_layer_config")
    value = (layer or {}).get("hidden_size") if isinstance(layer, dict) else config.get("hidden_size")
    return int(value) if isinstance(value, int) else None


def is_exported_dir(directory: str | os.PathLike) -> bool:
    """A directory in one of the engine formats (not our own head format); never raises."""
    try:
        config = read_json(Path(directory) / CONFIG_NAME)
    except SpecHeadsError:
        return False
    return config.get("format") != "specheads" and detect_format(config, Path(directory)) is not None


def source_head_config(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The specheads head config an export was made from (its target name, layer ids, training),
    or None for a checkpoint written by another tool. Never raises."""
    try:
        block = read_json(Path(directory) / CONFIG_NAME).get(PROVENANCE_KEY)
    except SpecHeadsError:
        return None
    config = block.get("head_config") if isinstance(block, dict) else None
    return config if isinstance(config, dict) and config.get("format") == "specheads" else None
