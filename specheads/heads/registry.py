"""The head families by name, and a fresh head built for a target."""

from __future__ import annotations

from ..config.train import HeadConfig
from ..errors import SpecHeadsError
from ..target import FrozenTarget, target_identity
from .base import DraftHead
from .dflash import DFlashHead
from .dflash2 import DFlash2Head
from .dspark import DSparkHead
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .early_exit import EarlyExitHead
from .hydra import HydraHead
from .medusa import MedusaHead
from .medusa2 import Medusa2Head
from .peagle import PEagleHead
from .spec import HeadSpec
from .vocab import DraftVocabulary, build_draft_vocab

HEADS: dict[str, type[DraftHead]] = {
    MedusaHead.family: MedusaHead,
    EagleHead.family: EagleHead,
    Eagle3Head.family: Eagle3Head,
    HydraHead.family: HydraHead,
    Medusa2Head.family: Medusa2Head,
    PEagleHead.family: PEagleHead,
    DFlashHead.family: DFlashHead,
    DSparkHead.family: DSparkHead,
    DFlash2Head.family: DFlash2Head,
    EarlyExitHead.family: EarlyExitHead,
}


def build_head(head_cfg: HeadConfig, target: FrozenTarget, train_rows=None) -> DraftHead:
    """A fresh head for `target`. A head with a reduced draft vocabulary (EAGLE-3, P-EAGLE, early exit
    with head.draft_vocab) builds it from `train_rows` (cached when the rows are a
    `datasets.Dataset`, keyed by its fingerprint)."""
    spec = HeadSpec.from_config(head_cfg, target.info)
    HEADS[spec.family].prepare_spec(spec, target)
    head = HEADS[spec.family](spec, target.info)
    head.attach(target)
    head.target_identity = target_identity(target)
    head.to(device=target.device, dtype=target.dtype)
    if isinstance(head, DraftVocabulary) and spec.draft_vocab_size < target.info.vocab_size:
        if train_rows is None:
            raise SpecHeadsError(
                f"{spec.family} with a reduced draft vocab needs training data to choose it from "
                f"(draft_vocab_size {spec.draft_vocab_size} < vocab {target.info.vocab_size})"
            )
        key = None
        fingerprint = getattr(train_rows, "_fingerprint", None)
        if fingerprint is not None:
            tok = target.tokenizer
            key = {
                "data": fingerprint,
                "target": target.info.name,
                "tokenizer": getattr(tok, "name_or_path", ""),
                "template": getattr(tok, "chat_template", "") or "",
            }
        d2t, t2d, coverage = build_draft_vocab(train_rows, target.info.vocab_size, spec.draft_vocab_size, key)
        head.set_vocab(d2t.to(head.d2t.device), t2d.to(head.t2d.device))
        head.vocab_coverage = coverage
    if hasattr(head, "init_from_target"):
        head.init_from_target()
    return head
