"""Temperature, top-k and top-p (nucleus) sampling: one definition for verification and distillation.

The rules are transformers' logits warpers (temperature, then top-k, then top-p): the lossless
rejection sampler must compare drafts with exactly the distribution the target samples from.
"""

from __future__ import annotations

import torch

# The nucleus almost always lies within the top few hundred tokens: sorting only those is much
# cheaper than sorting a 50k vocabulary. A wider nucleus widens the candidates.
TOP_P_CANDIDATES = 512


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most probable tokens whose mass reaches top_p (never empty).

    Returns (probabilities, token ids) of the candidates, most probable first, with the tokens
    outside the nucleus zeroed (not renormalised). Same set as transformers' TopPLogitsWarper,
    which drops the least probable tail whose mass is at most 1 - top_p.
    """
    k = TOP_P_CANDIDATES
    while True:
        top_probs, top_ids = probs.topk(min(k, probs.shape[-1]), dim=-1)  # sorted, descending
        if k >= probs.shape[-1] or bool((top_probs.sum(-1) >= top_p).all()):
            break
        k *= 4
    outside = top_probs.cumsum(-1) - top_probs >= top_p  # the mass before it already reaches top_p
    return top_probs.masked_fill(outside, 0.0), top_ids


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Next-token probabilities [..., V] after temperature, top-k and top-p.

    The same function shapes both the target's and (when drafts are sampled) the draft's
    distribution, so the rejection rule compares like with like.
    """
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0 (temperature 0 is greedy)")
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if top_p < 1.0:
        kept, ids = nucleus(probs, top_p)
        probs = torch.zeros_like(probs).scatter_(-1, ids, kept)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token id per row of logits [B, V]: argmax at temperature 0, else a top-p draw.

    Draws from the nucleus candidates only, so a batch over a large vocabulary is never sorted
    in full.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    kept, ids = nucleus(probs, top_p)
    choice = torch.multinomial(kept, 1, generator=generator)
    return ids.gather(-1, choice).squeeze(1)
