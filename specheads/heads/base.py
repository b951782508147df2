"""What every draft head shares: its spec, its target's info, and frozen references to the target.

The frozen target parts (embedding, LM head, final norm) are kept out of the module tree on
purpose: DeepSpeed then wraps, shards and checkpoints the trainable head only, and the saved
head holds no copy of the target's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import SpecHeadsError
from ..target import FrozenTarget, TargetInfo, describe_identity, finish_logits, target_identity
from .spec import HeadSpec


class FrozenParts:
    """Plain references (not submodules) to the target's embedding, LM head and final norm."""

    def __init__(self, target: FrozenTarget):
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.final_norm = target.final_norm
        self.config = target.model.config  # how the target finishes its logits (finish_logits)


class DraftHead(nn.Module):
    family: ClassVar[str] = ""
    title: ClassVar[str] = ""  # the family's name in prose (model cards)
    # How inference drafts a tree: "parallel" (every depth from the last accepted target state),
    # "sequential" (level by level, a node's children from the head of its depth given the node's
    # path), "autoregressive" (a draft decoder run level by level), "parallel_decoder" (a draft
    # decoder filling every depth in one forward, P-EAGLE and DFlash) or "markov_block" (DSpark: one
    # block forward, then each node's children biased by the node's token; DFlash2: reranked by its
    # candidate selector after the node's token); decode picks the drafter by it.
    draft_kind: ClassVar[str] = ""
    # The static tree (rank paths) drafted when the head stores no default_tree; None: a dynamic tree.
    fallback_tree: ClassVar[tuple[tuple[int, ...], ...] | None] = None
    # Whether the head trains an adapter of the target with itself (Medusa-2's LoRA): its loss then
    # runs the target itself, and the adapted target is the one the head drafts for.
    adapts_target: ClassVar[bool] = False
    # Families whose finished heads this family can start from (train.init_from): their tensors
    # are a subset of ours; `own_tensors` (top-level names) are the ones that then start fresh.
    grows_from: ClassVar[tuple[str, ...]] = ()
    own_tensors: ClassVar[tuple[str, ...]] = ()
    # a head whose draft vocabulary is only a choice of the target's own LM-head rows: continued by
    # train.init_from, it may gain the maps (d2t, t2d) from this run's data that its source lacks
    vocab_from_data: ClassVar[bool] = False

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__()
        self.spec = spec
        self.info = info
        self.__dict__["_frozen"] = None  # bypass nn.Module registration on purpose
        self.default_tree: list | None = None
        # how default_tree was calibrated (bench/calibrate.py: its prompts, machine, measured tau)
        self.calibration: dict | None = None
        # the identity of the target it was trained on (specheads.target.target_identity): a digest
        # of the weights it reads and how they were loaded; None for a head that never recorded one
        self.target_identity: dict | None = None
        # the record of the run that wrote it (config.json "training": steps, batch, command, data)
        self.training_record: dict | None = None
        self.steps_done = 0  # optimizer steps trained so far, set by the Trainer (Medusa-2's stages)

    # -- target wiring -------------------------------------------------------------------
    def attach(self, target: FrozenTarget) -> DraftHead:
        check_compatible(self.info, target.info)
        self.__dict__["_frozen"] = FrozenParts(target)
        return self

    @property
    def frozen(self) -> FrozenParts:
        if self._frozen is None:
            raise RuntimeError("head is not attached to a target; call head.attach(target)")
        return self._frozen

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.frozen.embed_tokens(input_ids).to(self.dtype)

    def target_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own next-token logits from its post-norm final state."""
        lm_head = self.frozen.lm_head
        return finish_logits(lm_head(final_hidden.to(lm_head.weight.dtype)).float(), self.frozen.config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # -- what the head reads ---------------------------------------------------------------
    # Medusa, Hydra and EAGLE-1 read only the post-norm final state; EAGLE-3 reads fused layer states.
    reads_final_state: ClassVar[bool] = False

    def target_layer_ids(self) -> list[int]:
        """Target states read at inference (our layer-id convention)."""
        return [] if self.reads_final_state else list(self.spec.layer_ids)

    @property
    def reads_final(self) -> bool:
        """Whether inference needs the post-norm final state."""
        return self.reads_final_state

    def training_states(self) -> tuple[list[int], bool]:
        """(layer ids, needs final) for the training loss; the final state gives target logits."""
        return sorted(set(self.target_layer_ids())), True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    # -- what the family can draft, and how it describes itself ---------------------------------
    @classmethod
    def max_draft_depth(cls, spec: HeadSpec) -> int | None:
        """The deepest tree a head of this spec can draft (None: no limit)."""
        return None

    @classmethod
    def prepare_spec(cls, spec: HeadSpec, target: FrozenTarget) -> None:
        """Resolve, in place, the spec fields a fresh head takes from the target's tokenizer."""

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        """One phrase saying what the head is (for model cards)."""
        raise NotImplementedError

    @classmethod
    def adopt_exported(
        cls, spec: HeadSpec, tensors: dict[str, torch.Tensor], target: FrozenTarget
    ) -> dict[str, torch.Tensor]:
        """Tensors read back from an engine export, in this head's terms (may adjust spec)."""
        return tensors

    def teacher_forced_logits(
        self, input_ids: torch.Tensor, states: dict[Any, torch.Tensor], depth: int
    ) -> list[torch.Tensor]:
        """Draft logits [B, T, Vd] (float) for depths 1..depth (fewer if the head drafts less deep):
        at depth d, position t holds the draft for token t+1+d, drafted along the true sequence."""
        raise NotImplementedError

    # -- the target's adapter (Medusa-2) and the files it needs beside model.safetensors -----
    def target_adapter(self) -> nn.Module | None:
        """The trainable part of the target that trains with the head, or None (a frozen target)."""
        return None

    def target_adapter_lr(self) -> float | None:
        """The adapter's own peak learning rate, or None for the heads' (train.lr)."""
        return None

    @classmethod
    def target_adapter_parameters(cls, spec: HeadSpec, info: TargetInfo) -> int:
        """The parameter count of the target adapter a head of this spec trains (for memory plans)."""
        return 0

    def save_files(self, directory: Path) -> None:
        """Write what the head directory holds besides config.json and model.safetensors."""

    def load_files(self, directory: Path) -> None:
        """Read it back (after the weights) when the head directory is loaded."""

    # -- training --------------------------------------------------------------------------
    def loss(self, batch: dict[str, torch.Tensor], states: dict[Any, torch.Tensor]):
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], states: dict[Any, torch.Tensor]):
        raise NotImplementedError


def check_compatible(head: TargetInfo, target: TargetInfo) -> None:
    """Refuse a head trained for a differently shaped target, with one readable line."""
    fields = ("hidden_size", "vocab_size", "num_layers")
    diffs = [
        f"{f} {getattr(head, f)} != {getattr(target, f)}" for f in fields if getattr(head, f) != getattr(target, f)
    ]
    if diffs:
        raise SpecHeadsError(
            f"head was trained for target {head.name!r} but the target is {target.name!r}: " + ", ".join(diffs)
        )


def check_same_target(
    recorded: dict | None, head_info: TargetInfo, target: FrozenTarget, allow_mismatch: bool = False, where: str = ""
) -> str | None:
    """Refuse a head trained on other weights of the same shape (another quantization, another
    fine-tune: its drafts would be accepted less often), naming both targets in one line; with
    allow_mismatch, return that line as a warning instead. None when the identities agree.
    A head that recorded no identity (made before specheads recorded one) gets a warning."""
    here = target_identity(target)
    if not recorded:
        return (
            f"{where or 'the head'} records no target identity (made by an older specheads): cannot check "
            f"that it was trained on the weights of {describe_identity(target.info.name, here)}"
        )
    if recorded.get("weights_sha256") == here["weights_sha256"]:
        return None
    line = (
        f"{where or 'the head'} was trained on target {describe_identity(head_info.name, recorded)} but this "
        f"target is {describe_identity(target.info.name, here)}: same shape, other weights"
    )
    if not allow_mismatch:
        raise SpecHeadsError(line + "; pass allow_target_mismatch=true to use it anyway")
    return line + " (allow_target_mismatch=true: going on)"


def shifted(x: torch.Tensor, k: int, fill: Any = 0) -> torch.Tensor:
    """x shifted left by k along dim 1 (position t holds x[t + k]); the tail is filled."""
    if k == 0:
        return x
    tail = x.new_full((x.shape[0], k) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, k:], tail], dim=1)


# -- packed batches (data.pack, specheads.data.packing) -----------------------------------------
# A packed row holds several conversations; its batch adds `document` (each token's conversation
# in the row, -1 on padding) and `position_ids` (restarting at 0 with every conversation). An
# unpacked row is one document (padding aside) at positions 0, 1, 2, ...; the helpers below give
# both kinds in one form, so a head's loss keeps attention, positions and shifted targets inside
# one conversation either way.


def documents(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] each token's document in its row (-1: padding)."""
    document = batch.get("document")
    if document is not None:
        return document
    return torch.where(batch["attention_mask"].bool(), 0, -1)


def positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] each token's position in its own conversation."""
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        return position_ids
    b, t = batch["input_ids"].shape
    return torch.arange(t, device=batch["input_ids"].device).expand(b, t)


def within(batch: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """Bool [B, T]: tokens t and t+k are both tokens of one conversation (for an unpacked row:
    both are real tokens). What every shifted target is cut by."""
    document = documents(batch)
    return (shifted(document, k, -1) == document) & (document >= 0)


def document_causal_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Bool [B, 1, T, T] for a packed batch: query t sees keys s <= t of its own document (padding
    sees the padding before it, never a conversation); None for an unpacked batch (a plain causal
    mask over the row already keeps its one conversation from the padding after it)."""
    document = batch.get("document")
    if document is None:
        return None
    t = document.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def chain_metrics(hits: torch.Tensor, counted: torch.Tensor) -> dict[str, torch.Tensor]:
    """hits, counted: bool [D, N] per depth. accept_lengths counts leading hits per position.

    A position is counted if its depth-0 prediction is counted; at deeper depths, positions whose
    target is past the sequence end stop the chain without counting as misses.
    """
    depth0 = counted[0]
    leading = torch.cumprod((hits & counted).long(), dim=0)  # 1 while every earlier depth hit
    accept = leading.sum(0)[depth0]
    return {
        "correct": (hits & counted).long().sum(1),
        "total": counted.long().sum(1),
        "accept_lengths": accept,
    }
