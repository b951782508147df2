"""The baselines speculative decoding is measured against: the target's own decoding with
transformers `generate`, plain or with prompt lookup decoding (drafts copied from the prompt), and
plain decoding through this package's own loop and forward path (`PlainDrafter`), so that a gain
of the forward path itself is not counted as a gain of speculation."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig

from ..kernels.gqa_attention import stock_attention
from ..kernels.linear_layout import stock_kernels
from ..target import synchronize
from .generate import SamplingConfig
from .tree import TreeLayout


@torch.no_grad()
def hf_generate(
    target, prompt: torch.Tensor, cfg: SamplingConfig, prompt_lookup: tuple[int, int] | None = None
) -> dict:
    """transformers `generate` (plain, or prompt lookup decoding); forwards counted with a hook.

    prompt_lookup: (prompt_lookup_num_tokens, max_matching_ngram_size). Returns output_ids,
    target_forwards (decode-phase: the prefill is not counted) and wall_s. The model runs as
    transformers ships it: kernels this package installed are suspended for the call.
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
    try:
        with stock_kernels(model), stock_attention(model):
            synchronize(target.device)
            t0 = time.perf_counter()
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg)
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
