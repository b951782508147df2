"""Batched generation for distillation: left padding, greedy or top-p sampling, seeded.

A small loop over the transformers KV cache instead of `model.generate`, for one reason: rows
that have finished are evicted from the batch (and its cache), so a batch of Magpie prompts of
very different lengths does not keep paying for its finished rows. Greedy output equals
`model.generate` (tested).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..sampling import sample

# Compact the batch once this share of its live rows has finished (a compaction copies the cache).
EVICT_FRACTION = 0.25


@dataclass
class Generation:
    tokens: list[int]  # generated ids, without the stop token
    finished: bool  # ended with a stop token (False: cut off by max_new_tokens)


@torch.inference_mode()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 32,
    seed: int = 0,
    desc: str | None = None,
) -> list[Generation]:
    """Continue every prompt (token ids); results in input order.

    Prompts are batched by length (less padding); sampling uses one seeded generator, so a run
    is reproducible for a given batch size.
    """
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Generation | None] = [None] * len(prompts)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc=desc, leave=False, disable=desc is None):
        outs = _generate_batch(
            model, [prompts[i] for i in batch], max_new_tokens, stop.to(device), pad_id, temperature, top_p, generator
        )
        for i, out in zip(batch, outs):
            results[i] = out
    return results  # type: ignore[return-value]


def _generate_batch(model, prompts, max_new_tokens, stop, pad_id, temperature, top_p, generator):
    device = stop.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for b, p in enumerate(prompts):
        if len(p):
            input_ids[b, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            attention[b, width - len(p) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = _last_logits(model, input_ids, attention, positions, cache)
    next_pos = positions[:, -1] + 1
    alive = torch.arange(len(prompts), device=device)  # original row of each live row
    tokens: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        nxt = sample(logits, temperature, top_p, generator)
        is_stop = torch.isin(nxt, stop)
        for row, tok, s, d in zip(alive.tolist(), nxt.tolist(), is_stop.tolist(), done.tolist()):
            if not d:
                if s:
                    finished[row] = True
                else:
                    tokens[row].append(tok)
        done |= is_stop
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if int(done.sum()) >= max(1, math.ceil(EVICT_FRACTION * len(alive))):
            keep = (~done).nonzero().squeeze(1)
            select_rows(cache, keep)
            alive, attention, next_pos, nxt, done = (
                alive[keep],
                attention[keep],
                next_pos[keep],
                nxt[keep],
                done[keep],
            )
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        logits = _last_logits(model, nxt[:, None], attention, next_pos[:, None], cache)
        next_pos = next_pos + 1
    return [Generation(t, f) for t, f in zip(tokens, finished)]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only `rows` of the batch in every layer of `cache`. Through reorder_cache, the one row
    selection every layer kind implements whole: batch_select_indices is missing on linear-attention
    layers (qwen3_next, granitemoehybrid) and, on a layer holding attention and Mamba states side by
    side (falcon_h1), selects the keys but not the recurrent states."""
    cache.reorder_cache(rows)


def _last_logits(model, input_ids, attention, positions, cache) -> torch.Tensor:
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()
