"""HeadSpec: a head's config (specheads.config.train.HeadConfig) with every default resolved
against its target. The "head" dict of a head directory's config.json is a HeadSpec's fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..config.train import HeadConfig, family_fields
from ..errors import SpecHeadsError
from ..target import TargetInfo
from .objectives import check_loss_fn

FAMILIES = ("medusa", "eagle", "eagle3", "hydra", "medusa2", "peagle", "dflash", "dspark", "dflash2", "early_exit")
# the families of the EAGLE-3 draft (fused target layers, a reduced draft vocabulary)
FUSED_FAMILIES = ("eagle3", "peagle")
# the families of DFlash's block drafter (heads/dflash.py; DSpark adds its Markov and confidence heads,
# DFlash2 its in-block convolutions and candidate selector)
BLOCK_FAMILIES = ("dflash", "dspark", "dflash2")
# DSpark's Markov heads this project drafts with (speculators' names; its recurrent "rnn" is not one)
MARKOV_HEAD_TYPES = ("vanilla", "gated")


@dataclass
class HeadSpec(HeadConfig):
    # The fields a HeadConfig leaves to the target, resolved (0 / [] only in a spec read back
    # without them: an engine export that does not store them).
    layer_ids: list[int] = field(default_factory=list)
    intermediate_size: int = 0
    draft_vocab_size: int = 0
    # depth of the chain used to measure per-position accuracy during evaluation
    eval_depth: int = 5

    @classmethod
    def from_config(cls, cfg: Any, info: TargetInfo) -> HeadSpec:
        """Resolve a HeadConfig (or a dict of its fields) against the target."""
        raw = asdict(cfg) if isinstance(cfg, HeadConfig) else dict(cfg)
        family = raw.get("family")
        if family not in FAMILIES:
            raise SpecHeadsError(f"unknown head family {family!r}; choose from {', '.join(FAMILIES)}")
        if family == "peagle" and raw.get("loss_positions", "in_vocab") != "in_vocab":  # before from_dict drops it
            raise SpecHeadsError("head.loss_positions=all is EAGLE-3's: a P-EAGLE head counts in-vocabulary positions")
        if raw.get("merge_lora") and family != "medusa2":  # checked before from_dict drops the field
            raise SpecHeadsError(f"head.merge_lora: a {family} head trains no LoRA (only medusa2 does)")
        # None means "the target's" for the fields resolved below; elsewhere it is a value (lora_lr)
        resolved = ("layer_ids", "intermediate_size", "draft_vocab_size")
        spec = cls.from_dict({k: v for k, v in raw.items() if v is not None or k not in resolved})
        if family == "early_exit":
            spec.resolve_exit_layer(raw.get("layer_ids"), info)
        spec.layer_ids = list(raw.get("layer_ids") or default_layer_ids(family, info.num_layers, spec.dflash_layers))
        if not spec.intermediate_size:
            spec.intermediate_size = info.intermediate_size
        if family in FUSED_FAMILIES or (family == "early_exit" and spec.draft_vocab):
            spec.draft_vocab_size = min(spec.draft_vocab_size or info.vocab_size, info.vocab_size)
        else:
            spec.draft_vocab_size = info.vocab_size
        if family == "early_exit":
            spec.layer_ids = [spec.exit_layer]  # the stream leaving its first exit_layer layers
        if family in ("medusa", "hydra", "medusa2"):
            spec.eval_depth = spec.num_heads  # one head per depth
        elif family == "eagle3":
            spec.eval_depth = max(spec.eval_depth, spec.ttt_steps)
        elif family == "peagle":
            spec.eval_depth = spec.parallel_depths
        elif family in BLOCK_FAMILIES:  # a block's drafts: block_size - 1, block_size when slot 0 drafts too
            spec.eval_depth = spec.block_size - (0 if family == "dspark" and spec.sample_from_anchor else 1)
        spec.validate(info)
        return spec

    def resolve_exit_layer(self, layer_ids: list[int] | None, info: TargetInfo) -> None:
        """early_exit: exit_layer (None: a quarter of the target's layers, at least 1); the layer
        ids it reads follow from it, so layer_ids may only repeat it."""
        if self.exit_layer is None:
            self.exit_layer = max(1, info.num_layers // 4)
        if layer_ids and list(layer_ids) != [self.exit_layer]:
            raise SpecHeadsError(
                f"head.layer_ids={list(layer_ids)}: an early_exit head reads the layer it exits at; set "
                f"head.exit_layer instead (now {self.exit_layer})"
            )
        if not 1 <= self.exit_layer <= info.num_layers:
            raise SpecHeadsError(
                f"head.exit_layer must be in 1..{info.num_layers} (the target's layers), got {self.exit_layer}"
            )

    def validate(self, info: TargetInfo) -> None:
        bad = [k for k in self.layer_ids if not 0 <= k <= info.num_layers]
        if bad:
            raise SpecHeadsError(f"layer ids {bad} out of range 0..{info.num_layers} for {info.name}")
        if self.family in FUSED_FAMILIES and len(self.layer_ids) < 1:
            raise SpecHeadsError(f"{self.family} needs at least one fused layer id")
        if self.family == "peagle":
            self.validate_parallel()
        if self.family in BLOCK_FAMILIES:
            self.validate_block()
        if self.family == "dspark":
            self.validate_markov()
        if self.family == "dflash2":
            self.validate_dflash2(info)
        for name in ("num_heads", "num_layers", "num_decoder_layers", "ttt_steps"):
            if getattr(self, name) < 1:
                raise SpecHeadsError(f"head.{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_positions not in ("in_vocab", "all"):
            raise SpecHeadsError(f"head.loss_positions must be in_vocab or all, got {self.loss_positions!r}")
        check_loss_fn(self.loss_fn, self.lk_eta)
        if self.noise not in ("uniform", "gaussian", "none"):
            raise SpecHeadsError(f"head.noise must be uniform, gaussian or none, got {self.noise!r}")
        if self.merge_lora and self.family != "medusa2":
            raise SpecHeadsError(f"head.merge_lora: a {self.family} head trains no LoRA (only medusa2 does)")
        if self.family == "medusa2":
            self.validate_lora()

    def validate_parallel(self) -> None:
        if self.parallel_depths < 1:
            raise SpecHeadsError(f"head.parallel_depths must be >= 1, got {self.parallel_depths}")
        if not (0 < self.depth_min_rate <= 1 and 0 < self.depth_keep_rate <= 1):
            raise SpecHeadsError(
                f"need 0 < head.depth_keep_rate <= 1 and 0 < head.depth_min_rate <= 1, got "
                f"{self.depth_keep_rate}, {self.depth_min_rate}"
            )

    def validate_block(self) -> None:
        if self.block_size < 2:
            raise SpecHeadsError(f"head.block_size must be >= 2 (the next token and a mask), got {self.block_size}")
        for name in ("dflash_layers", "anchors_per_sequence"):
            if getattr(self, name) < 1:
                raise SpecHeadsError(f"head.{name} must be >= 1, got {getattr(self, name)}")
        if not self.dflash_gamma > 0:
            raise SpecHeadsError(f"head.dflash_gamma must be > 0, got {self.dflash_gamma}")
        if not self.layer_ids:
            raise SpecHeadsError(f"{self.family} needs at least one target layer id")

    def validate_markov(self) -> None:
        if self.markov_rank < 1:
            raise SpecHeadsError(
                f"head.markov_rank must be >= 1 (a dspark head always has its Markov head; head=dflash drafts "
                f"without one), got {self.markov_rank}"
            )
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise SpecHeadsError(
                f"head.markov_head_type must be {' or '.join(MARKOV_HEAD_TYPES)}, got {self.markov_head_type!r}"
            )
        if not self.confidence_head_alpha >= 0:
            raise SpecHeadsError(f"head.confidence_head_alpha must be >= 0, got {self.confidence_head_alpha}")
        if not 0 <= self.confidence_threshold < 1:
            raise SpecHeadsError(f"head.confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        if self.confidence_threshold > 0 and not self.enable_confidence_head:
            raise SpecHeadsError(
                f"head.confidence_threshold={self.confidence_threshold} needs the confidence head "
                "(head.enable_confidence_head=true)"
            )

    def validate_dflash2(self, info: TargetInfo) -> None:
        if self.conv_kernel_size < 1:
            raise SpecHeadsError(
                f"head.conv_kernel_size must be >= 1 (1: no mixing of slots), got {self.conv_kernel_size}"
            )
        if self.conv_group_size < 1 or info.hidden_size % self.conv_group_size:
            raise SpecHeadsError(
                f"head.conv_group_size must divide the target's hidden size {info.hidden_size} (channels per "
                f"convolution group), got {self.conv_group_size}"
            )
        for name in ("selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise SpecHeadsError(f"head.{name} must be >= 1, got {getattr(self, name)}")
        if self.selector_top_k > info.vocab_size:
            raise SpecHeadsError(
                f"head.selector_top_k must be at most the vocabulary size {info.vocab_size}, got {self.selector_top_k}"
            )
        if not self.selector_loss_weight >= 0:
            raise SpecHeadsError(f"head.selector_loss_weight must be >= 0, got {self.selector_loss_weight}")

    def validate_lora(self) -> None:
        if self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise SpecHeadsError(
                f"need head.lora_r >= 1, head.lora_alpha > 0 and 0 <= head.lora_dropout < 1, got "
                f"{self.lora_r}, {self.lora_alpha}, {self.lora_dropout}"
            )
        # the heads read the target's embedding and LM head as frozen parts, outside any adapter
        outside = [m for m in self.lora_target_modules if m in ("lm_head", "embed_tokens")]
        if not self.lora_target_modules or outside:
            raise SpecHeadsError(
                f"head.lora_target_modules must name decoder-layer projections (q_proj, ..., down_proj), "
                f"got {list(self.lora_target_modules)}"
            )
        for name in ("heads_only_steps", "lm_loss_weight", "lm_loss_warmup_steps"):
            if getattr(self, name) < 0:
                raise SpecHeadsError(f"head.{name} must be >= 0, got {getattr(self, name)}")
        if self.lm_loss not in ("kl", "ce"):
            raise SpecHeadsError(f"head.lm_loss must be kl or ce, got {self.lm_loss!r}")
        if self.lora_lr is not None and not self.lora_lr > 0:
            raise SpecHeadsError(f"head.lora_lr must be > 0 (or null for train.lr), got {self.lora_lr}")

    def to_dict(self) -> dict[str, Any]:
        """config.json's "head" dict: the fields of this head's own family only."""
        own = family_fields(self.family)
        return {k: v for k, v in asdict(self).items() if k in own}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadSpec:
        """A spec from config.json's "head" dict. Keys this version does not know, and the other
        families' fields that older heads stored beside their own, are ignored."""
        known = {f.name for f in fields(cls)} & set(family_fields(data.get("family", "")))
        return cls(**{k: v for k, v in data.items() if k in known})


def default_layer_ids(family: str, num_layers: int, draft_layers: int = 1) -> list[int]:
    """Our convention (residual stream entering layer k). Medusa/EAGLE-1/Hydra read the final state;
    DFlash and DSpark read `draft_layers` layers spread over the target's depth."""
    if family in BLOCK_FAMILIES:
        return spread_layer_ids(num_layers, draft_layers)
    if family in FUSED_FAMILIES:
        # EAGLE-3 / vLLM default aux layers: low, mid, high, always three (repeats on a shallow
        # target, as the engines build them), so the fc input is 3 x hidden for every target.
        return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]
    return []


def spread_layer_ids(num_layers: int, n: int) -> list[int]:
    """DFlash's target layers (z-lab build_target_layer_ids): n outputs of layers spread evenly from
    layer 1 to layer L-3, or the middle layer's for n = 1, in our numbering (the output of layer i
    is the stream entering layer i + 1), kept inside 1..L-1 where vLLM captures them."""
    if n == 1:
        ids = [num_layers // 2 + 1]
    else:
        start, end = 1, num_layers - 3
        ids = [round(start + i * (end - start) / (n - 1)) + 1 for i in range(n)]
    return [min(max(k, 1), max(num_layers - 1, 1)) for k in ids]
