"""Medusa-2 (Cai et al. 2024): Medusa heads trained jointly with a peft LoRA on the target.

Stage 1 (head.heads_only_steps optimizer steps) trains the heads alone on the unchanged target.
Stage 2 trains heads and LoRA together: the target's forward runs with grad through the LoRA (its
base weights stay frozen), and the loss is the heads' Medusa loss on the adapted target's final
states plus lambda x the adapted target's own next-token loss on the same rows, lambda ramping
from 0 over head.lm_loss_warmup_steps joint steps. That loss is by default the KL divergence from
the original target (the same forward with the LoRA switched off), which holds the adapted target's
answers to the original's whatever the data; head.lm_loss=ce trains on the data's tokens instead.

The adapted target is the new target. The head directory holds the adapter in peft's own format
(ADAPTER_DIR), and loading the head folds it into the target's weights, so that decoding is
lossless with respect to the adapted target (and differs from the original's).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..atomic import write_directory
from ..errors import SpecHeadsError, first_line
from ..target import FrozenTarget, TargetInfo, forward_masks
from .base import shifted, within
from .medusa import MedusaHead
from .spec import HeadSpec

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A target's config key naming the adapter folded into its weights (the sha256 of its weights file):
# loading the head onto that target (OUTPUT_DIR/merged, or one loaded before) must not fold it twice.
MERGED_KEY = "specheads_merged_adapter"


class Medusa2Head(MedusaHead):
    family = "medusa2"
    title = "Medusa-2"
    adapts_target = True

    def __init__(self, spec: HeadSpec, info: TargetInfo):
        super().__init__(spec, info)
        # Outside the module tree, as the frozen parts: the target (whose forward the loss runs), the
        # live peft model and its LoRA modules while training, or the adapter files the head was loaded from.
        self.__dict__.update(_target=None, _peft=None, _lora=None, _adapter_source=None)

    def attach(self, target: FrozenTarget) -> Medusa2Head:
        super().attach(target)
        self.__dict__["_target"] = target
        return self

    def init_from_target(self) -> None:
        """A fresh head: per-head LM heads copied from the target's, and a fresh LoRA on the target
        (B = 0, so the adapted target starts equal to the original)."""
        super().init_from_target()
        self.__dict__["_peft"] = add_lora(self._target, self.spec)
        self.__dict__["_lora"] = lora_modules(self._target.model)

    def target_adapter(self) -> nn.Module | None:
        return self._lora

    def target_adapter_lr(self) -> float | None:
        return self.spec.lora_lr

    @classmethod
    def target_adapter_parameters(cls, spec: HeadSpec, info: TargetInfo) -> int:
        """r x (fan-in + fan-out) per adapted projection of every decoder layer (names outside the
        Llama-style projections count nothing)."""
        h, i = info.hidden_size, info.intermediate_size
        q, kv = info.num_attention_heads * info.head_dim, info.num_key_value_heads * info.head_dim
        sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
        sizes.update(gate_proj=h + i, up_proj=h + i, down_proj=i + h)
        return info.num_layers * spec.lora_r * sum(sizes.get(m, 0) for m in spec.lora_target_modules)

    @classmethod
    def describe(cls, spec: HeadSpec, info: TargetInfo, layer_ids: list[int]) -> str:
        return (
            f"{spec.num_heads} Medusa heads ({spec.num_layers} ResBlock each) on the final state of the target "
            f"adapted by a rank-{spec.lora_r} LoRA trained with them"
        )

    # -- training ----------------------------------------------------------------------------
    def training_states(self) -> tuple[list[int], bool]:
        return [], False  # none from the state source: the loss runs the adapted target itself

    def joint(self) -> bool:
        return self.steps_done >= self.spec.heads_only_steps

    def lm_weight(self) -> float:
        """lambda: 0 in stage 1, then a linear ramp to head.lm_loss_weight."""
        joint_steps = self.steps_done - self.spec.heads_only_steps
        if joint_steps < 0:
            return 0.0
        warmup = self.spec.lm_loss_warmup_steps
        return self.spec.lm_loss_weight * (min(1.0, joint_steps / warmup) if warmup else 1.0)

    def adapted_final(self, batch) -> torch.Tensor:
        """[B, T, H] the adapted target's post-norm final states; with grad through the LoRA in stage 2."""
        return self._target.states(batch["input_ids"], **forward_masks(batch), final=True, grad=self.joint()).final

    def lm_loss(self, batch, final: torch.Tensor) -> torch.Tensor:
        """The adapted target's own loss at the positions that predict an assistant token: KL from the
        original target's next-token distribution (head.lm_loss=kl), or cross-entropy on the data."""
        counted = (shifted(batch["loss_mask"].bool(), 1, False) & within(batch, 1)).flatten().nonzero().squeeze(1)
        # only the counted positions go through the LM head: prompts and padding would cost a
        # vocabulary-wide row each for nothing
        logits = self.target_logits(final.flatten(0, 1)[counted])
        if self.spec.lm_loss == "kl":
            teacher = self.target_logits(self.original_final(batch).flatten(0, 1)[counted])
            per_token = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="none")
            per_token = per_token.sum(-1)
        else:
            per_token = F.cross_entropy(logits, shifted(batch["input_ids"], 1).flatten()[counted], reduction="none")
        return per_token.sum() / max(len(counted), 1)

    @torch.no_grad()
    def original_final(self, batch) -> torch.Tensor:
        """[B, T, H] the original target's final states: the same forward with the LoRA switched off."""
        with self._peft.disable_adapter():
            return self._target.states(batch["input_ids"], **forward_masks(batch), final=True).final

    def loss(self, batch, states):
        final = self.adapted_final(batch)
        heads, metrics = super().loss(batch, {"final": final})
        weight = self.lm_weight()
        metrics.update(lm_weight=weight)
        if weight == 0:  # stage 1 (or lambda = 0): the target's own loss would cost a forward for nothing
            return heads, metrics
        lm = self.lm_loss(batch, final)
        metrics.update(lm_loss=lm.item())
        return heads + weight * lm, metrics

    @torch.no_grad()
    def evaluate(self, batch, states):
        return super().evaluate(batch, {"final": self.adapted_final(batch)})

    # -- files -------------------------------------------------------------------------------
    def save_files(self, directory: Path) -> None:
        if self._peft is not None:
            self._peft.save_pretrained(str(directory / ADAPTER_DIR), safe_serialization=True)
        else:  # loaded: the same files, whose digest marks the targets they are folded into
            shutil.copytree(self._adapter_source, directory / ADAPTER_DIR)

    def load_files(self, directory: Path) -> None:
        source = directory / ADAPTER_DIR
        fold_adapter(self._target, source)
        self.__dict__["_adapter_source"] = source

    def save_merged_target(self, out: Path, head_dir: Path) -> Path:
        """Write the adapted target with the LoRA folded into its weights, a transformers model
        directory usable as model.path (the live model is left as it is). head_dir: where the
        head's adapter was saved, whose digest marks the merged target."""
        model, tokenizer = self._target.model, self._target.tokenizer
        config = copy.deepcopy(model.config)
        setattr(config, MERGED_KEY, adapter_digest(head_dir / ADAPTER_DIR))

        def fill(tmp: Path) -> None:
            model.save_pretrained(tmp, state_dict=merged_state_dict(model))
            config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

        return write_directory(out, fill)


def add_lora(target: FrozenTarget, spec: HeadSpec) -> PeftModel:
    """A fresh LoRA injected into the target's model in place (the target now runs through it).
    Only the LoRA is trainable; it takes the target's dtype, as the head does."""
    if has_adapter(target):
        raise SpecHeadsError("the target already carries a LoRA adapter: train a medusa2 head on the original target")
    config = LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=list(spec.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with quiet_peft():
            return get_peft_model(target.model, config, autocast_adapter_dtype=False)
    except ValueError as err:
        first = str(err).strip().splitlines()[0]
        raise SpecHeadsError(f"head.lora_target_modules {list(spec.lora_target_modules)}: {first}") from None


@contextlib.contextmanager
def quiet_peft():
    """peft calls a transformers method that transformers 5 deprecates: a FutureWarning per call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def lora_modules(model: nn.Module) -> nn.ModuleDict:
    """Every adapted layer's LoRA A, B and dropout (whose train/eval mode then follows the trainer's),
    named after the layer: what the trainer optimizes besides the head."""
    return nn.ModuleDict(
        {
            name.replace(".", "-"): nn.ModuleDict({"A": m.lora_A, "B": m.lora_B, "dropout": m.lora_dropout})
            for name, m in model.named_modules()
            if isinstance(m, LoraLayer)
        }
    )


def has_adapter(target: FrozenTarget) -> bool:
    """Whether a LoRA is injected into, or folded into, the target's model."""
    folded = getattr(target.model.config, MERGED_KEY, None) is not None
    return folded or any(isinstance(m, BaseTunerLayer) for m in target.model.modules())


def adapter_digest(source: Path) -> str:
    weights = source / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise SpecHeadsError(f"{source.parent} is a medusa2 head without its adapter ({ADAPTER_DIR}/{ADAPTER_WEIGHTS})")
    return hashlib.sha256(weights.read_bytes()).hexdigest()


def fold_adapter(target: FrozenTarget, source: Path) -> None:
    """Fold the saved LoRA into the target's weights (peft's merge_and_unload): the target becomes
    the adapted one. A target with this adapter folded in already is left as it is."""
    digest = adapter_digest(source)
    if getattr(target.model.config, MERGED_KEY, None) == digest:
        return
    if has_adapter(target):
        raise SpecHeadsError(f"the target already carries another LoRA adapter; load {source.parent} onto the original")
    try:
        with quiet_peft():
            PeftModel.from_pretrained(target.model, str(source)).merge_and_unload()
    except (ValueError, OSError, KeyError) as err:
        first = first_line(err)
        raise SpecHeadsError(f"cannot apply the adapter {source} to the target: {first}") from None
    setattr(target.model.config, MERGED_KEY, digest)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights on the CPU with every LoRA delta added in, under the plain module names."""
    state = {
        name.replace(".base_layer.", "."): tensor.detach().to("cpu")
        for name, tensor in model.state_dict().items()
        if ".lora_" not in name
    }
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                key = f"{name}.weight"
                state[key] = state[key] + module.get_delta_weight(adapter).to("cpu", state[key].dtype)
    return state
