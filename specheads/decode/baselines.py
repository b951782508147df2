"""The baselines speculative decoding is measured against: the target's own decoding with
transformers `generate`, plain, with prompt lookup decoding (drafts copied from the prompt) or with
assisted generation (drafts from a separate small model, `assistant_model`), and plain decoding
through this package's own loop and forward path (`PlainDrafter`), so that a gain of the forward
path itself is not counted as a gain of speculation."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from ..kernels.gqa_attention import stock_attention
from ..kernels.linear_layout import stock_kernels
from ..target import synchronize
from .generate import SamplingConfig
from .tree import TreeLayout


@dataclass(frozen=True)
class Assistant:
    """transformers' assisted generation: `model` (a causal LM with the target's tokenizer) drafts
    `tokens` tokens per step, under transformers' num_assistant_tokens_schedule `schedule`; its other
    settings (the confidence threshold that stops a draft early, ...) are transformers' defaults.
    `tokenizer` is given only when the vocabularies' sizes differ (transformers then re-encodes
    the drafts as text: universal assisted decoding)."""

    model: Any
    tokens: int
    schedule: str = "constant"
    tokenizer: Any = None


@contextlib.contextmanager
def _assistant_settings(assistant: Assistant, pad: int | None):
    """The assistant's generation config for one call, restored after it (a heuristic schedule
    writes its last draft length back into the assistant's config: each call starts afresh)."""
    gen = assistant.model.generation_config
    saved = {
        k: getattr(gen, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "pad_token_id")
    }
    gen.num_assistant_tokens = assistant.tokens
    gen.num_assistant_tokens_schedule = assistant.schedule
    if gen.pad_token_id is None:
        gen.pad_token_id = pad
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(gen, k, v)


@torch.no_grad()
def hf_generate(
    target,
    prompt: torch.Tensor,
    cfg: SamplingConfig,
    prompt_lookup: tuple[int, int] | None = None,
    assistant: Assistant | None = None,
) -> dict:
    """transformers `generate` (plain, prompt lookup decoding, or assisted generation); the target's
    forwards counted with a hook.

    prompt_lookup: (prompt_lookup_num_tokens, max_matching_ngram_size); assistant: a draft model
    (Assistant). Returns output_ids, target_forwards (decode-phase: the prefill is not counted) and
    wall_s. The models run as transformers ships them: kernels this package installed are suspended
    for the call.
    """
    model = target.model
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    eos = list(cfg.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=pad if pad is not None else (eos[0] if eos else None),
    )
    if cfg.temperature > 0:
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if prompt_lookup:
        kwargs.update(prompt_lookup_num_tokens=prompt_lookup[0], max_matching_ngram_size=prompt_lookup[1])
    gen_cfg = GenerationConfig(**kwargs)
    extra: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    if assistant is not None and assistant.model is model:
        raise ValueError("a model cannot assist itself here: the hook would count its drafting as target forwards")
    if assistant is not None:
        extra["assistant_model"] = assistant.model
        if assistant.tokenizer is not None:
            extra.update(tokenizer=target.tokenizer, assistant_tokenizer=assistant.tokenizer)
        stack.enter_context(_assistant_settings(assistant, kwargs["pad_token_id"]))
        stack.enter_context(stock_kernels(assistant.model))
        stack.enter_context(stock_attention(assistant.model))
    try:
        with stack, stock_kernels(model), stock_attention(model):
            synchronize(target.device)
            t0 = time.perf_counter()
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg, **extra)
            synchronize(target.device)
            wall = time.perf_counter() - t0
    finally:
        handle.remove()
    ids = out[0, prompt.shape[1] :].tolist()
    # a multi-token step may carry tokens past EOS: the answer ends at the first EOS
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[: i + 1]
            break
    return {"output_ids": ids, "target_forwards": max(calls[0] - 1, 0), "wall_s": wall}


class PlainDrafter:
    """Drafts nothing: each step verifies the root alone, so the speculative loop decodes one
    token per target forward (tau 1.0) through the same forward path, cache and bookkeeping."""

    layer_ids: tuple[int, ...] = ()
    reads_final = False
    _ROOT_ONLY = TreeLayout((-1,))

    def start(self, prompt, states, root) -> None:
        pass

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        return [root], self._ROOT_ONLY

    def advance(self, states, accepted: list[int], bonus: int) -> None:
        pass
