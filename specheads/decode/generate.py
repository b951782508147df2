"""The speculative generation loop: prefill -> draft a tree -> verify it in one target forward -> commit.

Batch size 1. The target runs its own (unmodified) transformers forward; a tree is verified by
passing a 4D attention mask (prefix + tree mask) and explicit position ids, so it works with the
eager and SDPA attention implementations. Counting conventions (docs/conventions.md):
  target_forwards  decode-phase forwards (the prefill is not counted)
  accept_lengths   tokens each decode forward emitted (accepted drafts + the target's own token)
  tau              mean accept length = (new tokens - the prefill's token) / target_forwards;
                   plain decoding has tau 1.0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..sampling import sampling_probs
from ..target import synchronize
from .kv import commit, new_cache, save_states, verify_tree
from .tree import FROM_HEAD, FROM_TEXT
from .verify import Acceptance, greedy_accept, speculative_accept, typical_accept

ACCEPTANCE_RULES = ("auto", "greedy", "speculative", "typical")
SOURCE_NAMES = {FROM_HEAD: "head", FROM_TEXT: "text", FROM_HEAD | FROM_TEXT: "both"}


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    # auto: greedy at temperature 0, lossless rejection sampling otherwise; typical is lossy.
    acceptance: str = "auto"
    typical_epsilon: float = 0.09
    typical_alpha: float = 0.3
    eos_token_ids: Sequence[int] = ()

    def rule(self) -> str:
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}")
        if self.acceptance == "auto":
            return "greedy" if self.temperature <= 0 else "speculative"
        return self.acceptance


def tau_of(new_tokens: int, target_forwards: int, answers: int = 1) -> float:
    """Tokens made by decode forwards per decode forward (1.0 without any): the first token of
    each of `answers` answers comes from its prefill, not from a decode forward."""
    return max(new_tokens - answers, 0) / target_forwards if target_forwards else 1.0


@dataclass
class GenerationResult:
    output_ids: list[int] = field(default_factory=list)  # generated tokens only
    drafted: list[bool] = field(default_factory=list)  # per output token: drafted and accepted
    accept_lengths: list[int] = field(default_factory=list)  # per decode forward
    accepted_drafts: list[int] = field(default_factory=list)  # per decode forward, before truncation
    tree_depths: list[int] = field(default_factory=list)  # per decode forward
    tree_sizes: list[int] = field(default_factory=list)  # per decode forward (root included)
    # accepted drafts that reached the output, by the drafter that proposed them (drafters that
    # say, tree.FROM_HEAD / FROM_TEXT): head only, text only, both
    accepted_sources: dict[str, int] = field(default_factory=dict)
    target_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    stopped_by: str = ""  # eos | max_new_tokens

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        return tau_of(self.new_tokens, self.target_forwards)


StepCallback = Callable[[list[int], list[bool]], None]


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    if cfg.temperature <= 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k)
    return int(torch.multinomial(probs, 1, generator=generator))


def accept(
    tokens: list[int], layout, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> Acceptance:
    rule = cfg.rule()
    if rule == "greedy":
        return greedy_accept(tokens, layout, logits)
    if rule == "typical":
        return typical_accept(
            tokens, layout, logits, cfg.temperature, cfg.typical_epsilon, cfg.typical_alpha, generator
        )
    probs = sampling_probs(logits, cfg.temperature, cfg.top_p, cfg.top_k)
    return speculative_accept(tokens, layout, probs, None, generator)


def _select(states: dict, index: torch.Tensor) -> dict:
    return {k: v.index_select(1, index.to(v.device)) for k, v in states.items()}


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    prompt_ids: torch.Tensor,
    cfg: SamplingConfig,
    on_step: StepCallback | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to cfg.max_new_tokens after `prompt_ids` ([1, T] or [T]).

    Never emits a token past the first EOS (which is emitted) or past max_new_tokens, even when
    a longer path was accepted. on_step(token_ids, drafted_flags) is called as tokens are committed.
    """
    model = target.model
    device = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    eos = set(int(e) for e in cfg.eos_token_ids)
    res = GenerationResult()
    cfg.rule()  # validate early

    def emit(tokens: list[int], drafted: list[bool]) -> tuple[bool, int]:
        """Commit tokens up to the limits; returns (generation is over, tokens committed)."""
        out_t, out_d = [], []
        for t, d in zip(tokens, drafted):
            if len(res.output_ids) + len(out_t) >= cfg.max_new_tokens:
                break
            out_t.append(t)
            out_d.append(d)
            if t in eos:
                break
        res.output_ids.extend(out_t)
        res.drafted.extend(out_d)
        if on_step and out_t:
            on_step(out_t, out_d)
        if res.output_ids and res.output_ids[-1] in eos:
            res.stopped_by = "eos"
        elif len(res.output_ids) >= cfg.max_new_tokens:
            res.stopped_by = "max_new_tokens"
        return bool(res.stopped_by), len(out_t)

    t0 = time.perf_counter()
    if cfg.max_new_tokens <= 0:
        res.stopped_by = "max_new_tokens"
        return res
    cache = new_cache(model, recurrent=True)  # a recurrent state: chains only, restored by commit
    if hasattr(drafter, "bind_target_cache"):  # a drafter that runs the target's own layers (early exit)
        drafter.bind_target_cache(cache)
    with target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
        out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    root = choose_token(out.logits[0, -1], cfg, generator)
    states = dict(store)
    synchronize(device)
    res.prefill_s = time.perf_counter() - t0
    done, _ = emit([root], [False])
    prefix_len = prompt.shape[1]
    if not done:
        drafter.start(prompt, states, root)
    while not done:
        t1 = time.perf_counter()
        remaining = cfg.max_new_tokens - len(res.output_ids)
        tokens, layout = drafter.draft(root, prefix_len, max_depth=remaining - 1)
        if tokens[0] != root:
            raise RuntimeError("a drafter must put the root token first")
        t2 = time.perf_counter()
        saved = save_states(cache)
        with target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
            out = verify_tree(target, tokens, layout, prefix_len, cache)
        res.target_forwards += 1
        acc = accept(tokens, layout, out.logits[0], cfg, generator)
        path = list(acc.path)
        new = [tokens[i] for i in path[1:]] + [acc.bonus]
        done, emitted = emit(new, [True] * (len(new) - 1) + [False])
        res.accept_lengths.append(emitted)
        res.accepted_drafts.append(acc.num_accepted)
        res.tree_depths.append(layout.max_depth)
        res.tree_sizes.append(layout.size)
        sources = getattr(drafter, "sources", None)
        if sources is not None:
            for node in path[1 : 1 + min(emitted, acc.num_accepted)]:
                key = SOURCE_NAMES[sources[node]]
                res.accepted_sources[key] = res.accepted_sources.get(key, 0) + 1
        if not done:
            # a recurrent state rewound after a partial accept costs one more target forward
            res.target_forwards += commit(target, cache, prefix_len, tokens, path, saved)
            prefix_len += len(path)
            drafter.advance(_select(dict(store), torch.tensor(path)), [tokens[i] for i in path], acc.bonus)
            root = acc.bonus
        elif hasattr(drafter, "finish"):  # no advance after the last step: hand over what it committed
            drafter.finish(new[:emitted])
        synchronize(device)
        t3 = time.perf_counter()
        res.draft_s += t2 - t1
        res.verify_s += t3 - t2
    res.wall_s = time.perf_counter() - t0
    return res
