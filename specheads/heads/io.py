"""Head directories: config.json (versioned schema) + model.safetensors (+ a family's own files,
Medusa-2's target adapter). Never pickle."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import write_directory
from ..chat_template import chat_mismatch
from ..config.infer import check_draft_dtype
from ..errors import SpecHeadsError
from ..kernels import linear_layout, weight_int8
from ..target import LAYER_CONVENTION, FrozenTarget, TargetInfo
from .base import DraftHead, check_same_target
from .registry import HEADS
from .spec import FUSED_FAMILIES, HeadSpec

SCHEMA_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_NAME = "specheads"


def head_config_dict(head: DraftHead, training: dict | None = None) -> dict[str, Any]:
    from .. import __version__

    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "specheads_version": __version__,
        "family": head.family,
        "head": head.spec.to_dict(),
        "target": {**head.info.to_dict(), **({"identity": head.target_identity} if head.target_identity else {})},
        "layer_ids": head.target_layer_ids(),
        "layer_convention": LAYER_CONVENTION,
        "reads": {"layer_ids": head.target_layer_ids(), "final_post_norm": head.reads_final},
        "vocab": {
            "target_vocab_size": head.info.vocab_size,
            "draft_vocab_size": head.spec.draft_vocab_size,
            "mapping": "d2t offsets (target_id = draft_id + d2t[draft_id])"
            if head.family in FUSED_FAMILIES
            else "identity",
        },
        "default_tree": head.default_tree,
        **({"calibration": head.calibration} if head.calibration else {}),
        "training": training or {},
    }


def save_head(
    head: DraftHead, directory: str | os.PathLike, training: dict | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write the head directory atomically (a temp directory renamed into place). `dtype` stores the
    float weights in another dtype (bf16 halves the file; loading casts back to the target's)."""

    def stored(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to("cpu")
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()

    def fill(tmp: Path) -> None:
        tensors = {k: stored(v) for k, v in head.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "family": head.family})
        (tmp / CONFIG_NAME).write_text(json.dumps(head_config_dict(head, training), indent=2) + "\n")
        head.save_files(tmp)

    return write_directory(directory, fill)


def read_head_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise SpecHeadsError(f"{directory} is not a head directory (no {CONFIG_NAME})")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpecHeadsError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
        raise SpecHeadsError(f"{path} is not a specheads head config (format != {FORMAT_NAME!r})")
    if config.get("schema_version", 0) > SCHEMA_VERSION:
        raise SpecHeadsError(
            f"{path} has schema version {config['schema_version']}; this specheads reads up to "
            f"{SCHEMA_VERSION}: upgrade specheads"
        )
    for key in ("family", "head", "target"):
        if key not in config:
            raise SpecHeadsError(f"{path} lacks the {key!r} field")
    return config


# heads already warned about on this process (a benchmark loads the same head more than once), by
# directory, and the chat-template warnings already given, by their line
_WARNED: set[str] = set()


def load_head(directory: str | os.PathLike, target: FrozenTarget, allow_target_mismatch: bool = False) -> DraftHead:
    """Load a head directory onto `target`; refuses a mismatched target or a corrupt file.

    A target of the right shape but other weights than the head recorded is refused too, unless
    allow_target_mismatch (then one line on stderr says so); a head recording no identity loads
    with a warning, once. Hub ids and engine-format directories are opened one layer up, by
    specheads.export.open_head.

    Args:
        directory: a head directory as train.py writes it (config.json + model.safetensors).
        target: the frozen target it drafts for (specheads.target.load_target).
        allow_target_mismatch: load it onto a target of its shape with other weights anyway.

    Returns:
        The head (a DraftHead of its family) with its weights, attached to `target`.

    Raises:
        SpecHeadsError: a missing or corrupt file, an unknown family, or a target that does not fit.
    """
    config = read_head_config(directory)
    family = config["family"]
    if family not in HEADS:
        raise SpecHeadsError(f"{directory}: unknown head family {family!r}")
    info = TargetInfo(**{k: v for k, v in config["target"].items() if k in TargetInfo.__dataclass_fields__})
    spec = HeadSpec.from_dict(config["head"])
    head = HEADS[family](spec, info)
    head.attach(target)
    recorded = config["target"].get("identity")
    warning = check_same_target(recorded, info, target, allow_target_mismatch, where=f"head {directory}")
    if warning and str(directory) not in _WARNED:
        _WARNED.add(str(directory))
        print(f"warning: {warning}", file=sys.stderr)
    head.target_identity = recorded
    warn_chat_once(directory, config, target)
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise SpecHeadsError(f"{directory} has no {WEIGHTS_NAME}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise SpecHeadsError(f"{weights} is not a readable safetensors file: {err}") from None
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecHeadsError(
            f"{weights} does not match a {family} head: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    head.default_tree = config.get("default_tree")
    head.calibration = config.get("calibration")
    head.training_record = config.get("training") or None
    head.load_files(Path(directory))
    return head.to(device=target.device, dtype=head_dtype(target)).eval()


def head_chat_mismatch(directory, config: dict, tokenizer) -> str | None:
    """One line when `tokenizer` renders chats otherwise than the head's training did (its
    config.json training.chat); None when they agree or the head records nothing (older heads)."""
    recorded = (config.get("training") or {}).get("chat")
    return chat_mismatch(recorded, tokenizer, f"head {directory} was trained on", "this target renders with")


def warn_chat_once(directory, config: dict, target: FrozenTarget) -> None:
    warning = head_chat_mismatch(directory, config, target.tokenizer) if target.tokenizer is not None else None
    if warning and warning not in _WARNED:
        _WARNED.add(warning)
        print(f"warning: {warning}", file=sys.stderr)


def head_dtype(target: FrozenTarget) -> torch.dtype:
    return target.dtype


def native_bf16_cpu() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where oneDNN's bf16 linear streams
    half the bytes of fp32 at fp32's speed; elsewhere bf16 is emulated and can be slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def halves_on_cpu(target: FrozenTarget, head: DraftHead) -> bool:
    """Whether "auto" drafts below the target's precision: an fp32 target on a CPU with native bf16,
    and a head that does not adapt the target (Medusa-2's LoRA keeps the target's dtype)."""
    cpu_fp32 = target.device.type == "cpu" and target.dtype == torch.float32
    return cpu_fp32 and not head.adapts_target and native_bf16_cpu()


def draft_dtype(name: str, target: FrozenTarget, head: DraftHead) -> torch.dtype:
    """The dtype a loaded head drafts in (infer.py's head_dtype; with int8 weights, its activations').

    Drafting decodes one to a few rows at a time, so on CPU its cost is the head's weights read
    from memory at every step: "auto" drafts in bf16 (on int8 weights, `int8_weights`) on an fp32
    target where the CPU has native bf16, and otherwise keeps the target's dtype. The draft's
    precision only changes which tokens it proposes; the target verifies them, so outputs are the
    target's in any dtype.
    """
    check_draft_dtype(name)
    if name in ("auto", "int8"):
        return torch.bfloat16 if halves_on_cpu(target, head) else target.dtype
    if name == "target":
        return target.dtype
    return getattr(torch, name)


def int8_weights(name: str, target: FrozenTarget, head: DraftHead) -> bool:
    """Whether the head's linear layers draft on int8 weights: under "int8", and under "auto"
    wherever it drafts in bf16 (BENCHMARKS.md "Drafting on int8 weights": the same acceptance,
    a cheaper draft step)."""
    return name == "int8" or (name == "auto" and halves_on_cpu(target, head))


def prepare_for_drafting(head: DraftHead, name: str, target: FrozenTarget) -> DraftHead:
    """Put a loaded head in the precision it drafts in (infer.py's head_dtype): its dtype, and its
    linear layers on int8 copies of their weights where `int8_weights` says so."""
    head.to(dtype=draft_dtype(name, target, head))
    if int8_weights(name, target, head):
        weight_int8.install(head)
    return head


def route_draft_kernels(head: DraftHead, layouts: linear_layout.RowLayouts) -> None:
    """The target's measured row kernels for the head's linear layers, unless they run int8."""
    if not weight_int8.installed(head):
        linear_layout.install(head, layouts)


def draft_precision(head: DraftHead) -> str:
    """What the head drafts in, as records name it: "bfloat16", or "int8" with its activations'
    dtype ("int8/bfloat16")."""
    dtype = str(head.dtype).removeprefix("torch.")
    return f"int8/{dtype}" if weight_int8.installed(head) else dtype


def warm_start(head: DraftHead, directory: str | os.PathLike, target: FrozenTarget) -> DraftHead:
    """Copy the weights of the head directory `directory` into the fresh `head` (train.init_from)
    and return the loaded source head, whose record the new head keeps.

    The source goes through load_head, so a corrupt file or another target is refused as there. It
    must be the same family (or one the head grows from, `DraftHead.grows_from`: a P-EAGLE head
    starts from an EAGLE-3 head, its mask feature fresh) with tensors of the same shapes: an
    EAGLE-3 head's draft vocabulary
    (d2t / t2d) comes with its weights, since its LM head's rows belong to those token ids; an
    early-exit head drafting over the target's own rows may gain one (head.draft_vocab). A head
    that adapts the target (Medusa-2) is refused: its saved LoRA is folded into the target when
    loaded, so there is no adapter left to continue.
    """
    if head.adapts_target:  # its LoRA is folded into the target on load, not weights to continue
        raise SpecHeadsError(f"train.init_from cannot continue a {head.family} head (its LoRA lives in the target)")
    source = load_head(directory, target)
    grows = source.family in head.grows_from  # P-EAGLE from EAGLE-3: its own tensors start fresh
    if source.family != head.family and not grows:
        raise SpecHeadsError(f"train.init_from={directory} is a {source.family} head; this run trains {head.family}")
    theirs, ours = source.state_dict(), head.state_dict()
    fresh = {k for k in ours if k.split(".")[0] in head.own_tensors} if grows else set()
    if head.vocab_from_data:  # its draft rows are the target's: maps from this run's data do
        fresh |= {"d2t", "t2d"} & ours.keys() - theirs.keys()
    missing, unexpected = sorted(ours.keys() - theirs.keys() - fresh), sorted(theirs.keys() - ours.keys())
    if missing or unexpected:
        raise SpecHeadsError(
            f"train.init_from={directory} lacks {missing[:5]} and has {unexpected[:5]} that this run's head "
            "does not; set head.* as its config.json has them"
        )
    for name, tensor in ours.items():
        if name not in fresh and theirs[name].shape != tensor.shape:
            raise SpecHeadsError(
                f"train.init_from={directory}: {name} is {tuple(theirs[name].shape)} there and "
                f"{tuple(tensor.shape)} here; set head.* as its config.json has them"
            )
    head.load_state_dict(theirs, strict=not fresh)
    return source
