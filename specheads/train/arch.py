"""The frozen target's sizes without its weights, for the memory plan (specheads.train.plan).

Where the numbers come from, first match wins:
  - a tiny target (`tiny:<arch>`): specheads.tiny's own config, with model.tiny's overrides;
  - a local directory: its config.json;
  - model.arch (conf/model/*.yaml carries the published numbers): nothing is read;
  - a Hub id: its config.json, fetched alone (never a weight file).
A local source beats model.arch because `model.path=DIR` on the command line would otherwise be
planned with the sizes of the group's default model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from ..config.model import ArchConfig, ModelConfig
from ..errors import SpecHeadsError
from ..target import EMBEDDED_PREFIX, TINY_PREFIX, TargetInfo, recurrent_layer_types

# config.json keys of a mixture-of-experts decoder, whose MLP the dense count below misses
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def layer_parameters(info: TargetInfo) -> int:
    """One dense decoder layer: attention, SwiGLU MLP and its two norms."""
    h, d = info.hidden_size, info.head_dim
    attention = 2 * h * info.num_attention_heads * d + 2 * h * info.num_key_value_heads * d
    return attention + 3 * h * info.intermediate_size + 2 * h


def vocab_parameters(info: TargetInfo, tied: bool) -> int:
    """What a head reads of the target besides its states: embedding, LM head and final norm."""
    return info.vocab_size * info.hidden_size * (1 if tied else 2) + info.hidden_size


def dense_parameters(info: TargetInfo, tied: bool) -> int:
    """A dense Llama-style decoder's parameter count; the q/k/v biases (Qwen2) and q/k norms
    (Qwen3) it leaves out are under 0.01% of a 7B model."""
    return info.num_layers * layer_parameters(info) + vocab_parameters(info, tied)


@dataclass(frozen=True)
class TargetArch:
    """A target's sizes (as TargetInfo, what a HeadSpec resolves against) and parameter counts."""

    info: TargetInfo
    tie_word_embeddings: bool
    num_parameters: int
    source: str  # where the numbers came from, said in the plan's header
    # a target counted from its model class (counted_parameters): the parameters one token runs
    # through (every routed expert but the num_experts_per_tok chosen left out), and the mean layer
    active_parameters: int | None = None
    mean_layer_parameters: int | None = None

    @property
    def layer_parameters(self) -> int:
        return self.mean_layer_parameters or layer_parameters(self.info)

    @property
    def vocab_parameters(self) -> int:
        return vocab_parameters(self.info, self.tie_word_embeddings)


def with_count(info: TargetInfo, tied: bool, num_parameters: int | None, source: str) -> TargetArch:
    return TargetArch(info, tied, num_parameters or dense_parameters(info, tied), source)


def from_arch_config(name: str, a: ArchConfig, source: str = "model.arch") -> TargetArch:
    heads = a.num_attention_heads
    info = TargetInfo(
        name=name,
        model_type="unknown",
        hidden_size=a.hidden_size,
        vocab_size=a.vocab_size,
        num_layers=a.num_layers,
        intermediate_size=a.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim or a.hidden_size // heads,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    arch = with_count(info, a.tie_word_embeddings, a.num_parameters, source)
    if a.active_parameters is None:
        return arch
    mean_layer = (arch.num_parameters - arch.vocab_parameters) // max(info.num_layers, 1)
    return replace(arch, active_parameters=a.active_parameters, mean_layer_parameters=mean_layer)


def counted_parameters(config) -> tuple[int, int]:
    """(all, active per token) parameters of the model transformers builds from `config`, built on
    the meta device (no memory, no weights). All: every expert, as the weights fill memory. Active:
    of the routed experts (the parameters under a module named `experts`, shared experts apart),
    num_experts_per_tok of each layer's num_experts, as one token runs through them."""
    import torch
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    experts = next((getattr(text, k) for k in EXPERT_KEYS if (getattr(text, k, None) or 0) > 1), 1)
    chosen = getattr(text, "num_experts_per_tok", None) or experts
    return total, total - routed + routed * chosen // experts


def from_hf_config(name: str, config, source: str) -> TargetArch:
    """From a transformers config (the model class's defaults fill what config.json leaves out). A
    mixture-of-experts or hybrid (Mamba, linear attention) target is counted from its model class
    (counted_parameters), a dense one by the formula above."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        info = TargetInfo.from_hf_config(config, name=name)
    except AttributeError as err:
        raise SpecHeadsError(f"{source} lacks a size the memory plan needs ({err})") from None
    tied = bool(getattr(text, "tie_word_embeddings", False))
    experts = [k for k in EXPERT_KEYS if (getattr(text, k, None) or 0) > 1]
    recurrent = recurrent_layer_types(config)
    if not experts and not recurrent:
        return with_count(info, tied, None, source)
    try:
        total, active = counted_parameters(config)
    except Exception as err:  # a model class transformers does not have (remote code): no count
        what = f"mixture-of-experts ({experts[0]}={getattr(text, experts[0])})" if experts else "hybrid"
        raise SpecHeadsError(
            f"{source} describes a {what} target whose model class transformers cannot build to count "
            f"({type(err).__name__}); set model.arch.num_parameters"
        ) from None
    mean_layer = (total - vocab_parameters(info, tied)) // max(info.num_layers, 1)
    return TargetArch(info, tied, total, source, active, mean_layer)


def from_config_json(name: str, path: Path, source: str) -> TargetArch:
    """From a config.json file (a local directory's, or the one fetched from the Hub)."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SpecHeadsError(f"cannot read {source}: {err}") from None
    try:  # the model class's defaults (tie_word_embeddings, head_dim, ...) where the file is silent
        config = AutoConfig.for_model(**raw)
    except (ValueError, KeyError, TypeError):
        config = PretrainedConfig.from_dict({"tie_word_embeddings": False, **raw})
    return from_hf_config(name, config, source)


def hub_config_json(repo_id: str, revision: str | None) -> Path:
    """The Hub repo's config.json alone (cached by huggingface_hub); one line when unreachable."""
    from huggingface_hub import hf_hub_download

    http_log = logging.getLogger("huggingface_hub.utils._http")
    level = http_log.level
    http_log.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except (OSError, ValueError) as err:  # offline, gated, missing repo, bad id: all OSError / ValueError
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(".")
        raise SpecHeadsError(
            f"cannot fetch the config.json of {repo_id!r} from the Hub ({type(err).__name__}: {first}); "
            "plan offline with model.arch (conf/model/*.yaml) or a local model.path"
        ) from None
    finally:
        http_log.setLevel(level)


def read_arch(cfg: ModelConfig) -> TargetArch:
    """The sizes of the target `cfg` describes, without loading (or downloading) any weight."""
    path = cfg.path
    if path.startswith(TINY_PREFIX):
        from ..tiny import tiny_config

        overrides = {k: v for k, v in cfg.tiny.items() if k != "seed"}
        try:
            config = tiny_config(path[len(TINY_PREFIX) :], **overrides)
        except ValueError as err:
            raise SpecHeadsError(str(err)) from None
        return from_hf_config(cfg.name, config, f"specheads.tiny ({path})")
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise SpecHeadsError(f"target directory {path} has no config.json to plan from")
        return from_config_json(cfg.name, local / "config.json", str(local / "config.json"))
    if cfg.arch is not None:
        return from_arch_config(cfg.name, cfg.arch)
    if path.startswith((".", "/", "~")) and not local.exists():
        raise SpecHeadsError(f"target path {path} does not exist")
    if path.startswith(EMBEDDED_PREFIX) or local.is_file():
        raise SpecHeadsError(f"no config.json to plan {path} from: set model.arch (see conf/model/*.yaml)")
    return from_config_json(cfg.name, hub_config_json(path, cfg.revision), f"the Hub's {path}/config.json")
