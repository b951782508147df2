"""skip.layers=auto: which decoder layers the target skips to draft for itself (decode/layer_skip.py),
how deep it drafts and where it stops, chosen by expected tokens per second on this machine.

1. Acceptance, exactly. The target writes its greedy answers to the calibration prompts (tree=auto's
   prompts and answer length). One full forward puts every position's keys and values in a cache;
   then the reduced stack drafts along the true continuation from every answer position at once,
   level by level (draft_along): level j's query for a step rooted at position s sits at s + j - 1
   and sees the full model's entries before s, its own earlier levels' and itself, which is exactly
   what the drafter sees at that step. So at every position and depth we know whether the draft is
   the target's next token, the target token's rank among the reduced stack's, and with what
   probability the reduced stack drafts its top token.
2. A chain of depth k with w - 1 alternatives beside each node (w ranks a level,
   tree.spine_paths), stopping where the chain's probability falls under g (tree.min_path_prob;
   calibrate.gated_depth), accepts at a step rooted at s the run of top-1 matches cut at the depth
   it drafts, plus one level more where the target's token is among that level's alternatives (a
   leaf: the path ends there); the next step is rooted past the bonus token. Walking the answer step
   by step (chain_walk, with bench/walk.py's walk) gives the steps the generation loop takes,
   accepted lengths and levels drafted. The alternatives cost no drafting: only the chain's nodes
   have children to draft.
3. Cost: a level of the reduced stack (the real drafter, timed right after a target forward, as in
   decoding) per level drafted, plus the target's verification of the root and the w nodes of
   every level drafted (calibrate.time_target), both after the context tree=auto times at
   (calibrate.step_context: the mean the loop's steps verify after).
4. Search (the layer-selection idea of Draft & Verify and SWIFT, made greedy): each layer skipped
   alone is scored by how often the level-1 draft is still the target's token; layers are then
   skipped in that order, least harmful first, and for each count m (up to skip.max_share of the
   layers) the depth, ranks a level (up to skip.width) and stop probability with the most expected
   tokens per second are found. The
   best over every m is stored; a choice stored before is scored on the same positions and costs and
   stays unless the new one is expected to be faster, and a calibration on fewer positions than it
   was made on changes nothing. The few leaders are timed again, more often, before the choice:
   the fastest of many noisy timings tends to be one that was timed too fast.

The choice goes to this machine's cache (cache_root()/layer_skip/<machine key>.json: the host, the
device, threads, the target's weights and dtype), like a calibrated tree.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from ..atomic import write_json
from ..config.infer import InferJobConfig, resolve_search
from ..data.chat import tokenize_conversation
from ..data.formats import load_conversations
from ..decode.baselines import hf_generate
from ..decode.kv import new_cache
from ..decode.layer_skip import LayerSkipDrafter, VocabReader, check_skipped, kept_layers
from ..decode.policy import TreePolicy, method_policy
from ..decode.target_layers import check_layer_family, crop_layers, run_layers
from ..decode.tree import spine_paths, static_tree
from ..errors import SpecHeadsError
from ..heads.vocab import build_draft_vocab
from ..target import cache_root, eos_token_ids
from .calibrate import GATES, calibration_prompts, gated_depth, step_context, time_repeated, time_target
from .inputs import sampling_config
from .trees import machine_description, machine_key, prompts_record, utc_now
from .walk import walk

CACHE_VERSION = 1
FINALISTS, FINALIST_REPEATS = 3, 15  # the candidates timed again before the choice, and how often
VOCAB_MAX_LENGTH = 4096  # tokens read per conversation when counting a draft vocabulary


@dataclass(frozen=True)
class LayerSkip:
    """What the layer-skip drafter drafts with: the skipped layers, its chain policy and its draft
    vocabulary (None: every token)."""

    layers: tuple[int, ...]
    policy: TreePolicy
    source: str  # where the choice came from (given, this machine's cache, a calibration just now)
    vocab: tuple[int, ...] | None = None

    def drafter(self, target) -> LayerSkipDrafter:
        return LayerSkipDrafter(target, self.layers, self.policy, self.vocab)

    def describe(self) -> dict[str, Any]:
        return {
            "skipped_layers": list(self.layers),
            "draft_vocab": len(self.vocab) if self.vocab is not None else None,
            "source": self.source,
        }


@dataclass
class Along:
    """The reduced stack's chain drafts along one answer: for each step root (answer position i),
    whether the level-j draft is the target's token there (matches[i][j - 1]), the target token's
    rank among the level's drafts (ranks[i][j - 1]; 0 where it matches) and the top draft's
    probability (probs[i][j - 1])."""

    matches: list[list[bool]]
    probs: list[list[float]]
    ranks: list[list[int]]


@torch.no_grad()
def full_cache(target, ids: Sequence[int]):
    """The target's cache after one forward over `ids`: every position's keys and values."""
    cache = new_cache(target.model)
    target.model(input_ids=torch.tensor([list(ids)], device=target.device), cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def draft_along(
    target,
    skipped: Sequence[int],
    ids: Sequence[int],
    start: int,
    depth: int,
    cache=None,
    vocab: Sequence[int] | None = None,
) -> Along:
    """Chain drafts of the reduced stack rooted at every position start..len(ids) - 2 (step 1 of the
    module docstring). `cache`: full_cache(target, ids), reused across skip sets (its kept layers
    are cropped back before returning). `vocab`: the draft vocabulary, as the drafter's; a target
    token outside it is never drafted (its rank is the vocabulary's size)."""
    ids = list(ids)
    total = len(ids)
    cache = full_cache(target, ids) if cache is None else cache
    layers = kept_layers(len(target.layers), skipped)
    reader = VocabReader(target, vocab)
    size = target.lm_head.weight.shape[0]
    draft_id = torch.arange(size) if reader.ids is None else torch.full((size,), -1, dtype=torch.long)
    if reader.ids is not None:
        draft_id[reader.ids.cpu()] = torch.arange(len(reader.ids))
    starts = list(range(start, total - 1))
    matches: list[list[bool]] = [[] for _ in starts]
    probs: list[list[float]] = [[] for _ in starts]
    ranks: list[list[int]] = [[] for _ in starts]
    slots: list[list[int]] = [[] for _ in starts]  # each start's earlier levels' cache slots
    past, device = total, target.device
    try:
        for level in range(1, depth + 1):
            rows = [r for r, s in enumerate(starts) if s + level < total]  # the true next token exists
            if not rows:
                break
            n = len(rows)
            visible = torch.zeros(n, past + n, dtype=torch.bool)
            for q, r in enumerate(rows):
                visible[q, : starts[r]] = True
                visible[q, slots[r]] = True
                visible[q, past + q] = True
            at = [starts[r] + level - 1 for r in rows]
            tokens = torch.tensor([[ids[p] for p in at]], device=device)
            states = run_layers(target, layers, target.embed_tokens(tokens), torch.tensor(at), cache, visible)
            logp = torch.log_softmax(reader.logits(states)[0].float(), dim=-1)
            top = logp.max(dim=-1)
            drafted = reader.to_target(top.indices).tolist()
            truth = draft_id[[ids[p + 1] for p in at]].to(logp.device)  # -1: outside the draft vocabulary
            above = (logp > logp.gather(1, truth.clamp(min=0)[:, None])).sum(dim=-1).tolist()  # ranks ahead of it
            for q, r in enumerate(rows):
                matches[r].append(drafted[q] == ids[at[q] + 1])
                probs[r].append(math.exp(float(top.values[q])))
                outside = int(truth[q]) < 0
                ranks[r].append(0 if matches[r][-1] else logp.shape[-1] if outside else max(int(above[q]), 1))
                slots[r].append(past + q)
            past += n
    finally:
        crop_layers(cache, layers, total)
    return Along(matches, probs, ranks)


def chain_walk(along: Along, depth: int, min_path_prob: float, width: int = 1) -> list[tuple[int, int]]:
    """The generation loop's steps over one answer with a chain of `depth` (w = `width` ranks a
    level, tree.spine_paths) stopping under min_path_prob: (drafts accepted, levels drafted) per
    step (step 2 of the module docstring). Near the end a step drafts no deeper than the tokens
    left after its bonus token, as the loop."""
    steps, n = [], len(along.matches)

    def step(i: int) -> int:  # the step rooted at position i (walk.walk: the next is past its bonus)
        cap = min(depth, n - i - 1)  # the loop's max_depth: tokens left less the bonus
        drafted = gated_depth(along.probs[i], cap, min_path_prob) if cap >= 1 else 0
        accepted = 0
        while accepted < drafted and along.matches[i][accepted]:
            accepted += 1
        if accepted < drafted and along.ranks[i][accepted] < width:
            accepted += 1  # an alternative beside the chain: a leaf, the path ends on it
        steps.append((accepted, drafted))
        return accepted

    walk([n], step)
    return steps


@torch.no_grad()
def time_level(
    target, skipped: Sequence[int], context: Sequence[int], repeats: int = 5, vocab: Sequence[int] | None = None
) -> float:
    """Seconds the drafter spends on one level of one node (the root) after `context`, timed as in
    decoding, at the mean the loop pays (calibrate.time_repeated)."""
    cache = full_cache(target, context[:-1])
    drafter = LayerSkipDrafter(target, skipped, static_tree([[0]]), vocab)
    drafter.bind_target_cache(cache)
    root, prefix = int(context[-1]), len(context) - 1
    return time_repeated(target, cache, root, lambda: drafter.draft(root, prefix, 1), repeats=repeats)


def best_setting(
    alongs: Sequence[Along], level_s: float, verify_s: dict[int, float], depth: int, width: int = 1
) -> dict[str, Any]:
    """The chain depth (1..depth), ranks a level (1..width) and stop probability (calibrate.GATES)
    with the most expected tokens per second, and what it expects: tau and the ratio to a plain
    step (verify_s[1]; verify_s[n]: a verification of n tokens)."""
    best: dict[str, Any] = {}
    for k in range(1, depth + 1):
        for w in range(1, width + 1):
            for gate in GATES:
                tokens = seconds = 0.0
                steps = 0
                for along in alongs:
                    for accepted, drafted in chain_walk(along, k, gate, w):
                        tokens += accepted + 1
                        seconds += drafted * level_s + verify_s[1 + drafted * w]
                        steps += 1
                rate = tokens / seconds if seconds else 0.0
                if rate > best.get("tokens_per_s", -1.0):
                    best = {
                        "depth": k,
                        "width": w,
                        "min_path_prob": gate,
                        "tau": tokens / steps if steps else 0.0,
                        "tokens_per_s": rate,
                        "expected_speedup": rate * verify_s[1],
                    }
    return best


def answer_vocab(path: str, target, size: int) -> tuple[list[int], float]:
    """The `size` most frequent answer tokens of the conversations at `path` (sorted target ids)
    and the share of their answer tokens these cover (heads/vocab.py, as a head's draft vocab)."""
    vocab_size = target.lm_head.weight.shape[0]
    if not 0 < size < vocab_size:
        raise SpecHeadsError(f"skip.draft_vocab must be below the target's {vocab_size} tokens, got {size}")
    conversations = load_conversations(path)
    rows = [
        tokenize_conversation(target.tokenizer, c, VOCAB_MAX_LENGTH)
        for c in tqdm(conversations, desc="layer skip: draft vocabulary", unit="conversation", file=sys.stderr)
    ]
    d2t, _, coverage = build_draft_vocab(rows, vocab_size, size)
    return (torch.arange(size) + d2t).tolist(), coverage


def skip_cache_path(target, kernels: bool) -> Path:
    return cache_root() / "layer_skip" / f"{machine_key(target, kernels)}.json"


def read_choice(path: Path) -> dict | None:
    """The stored choice, or None (missing, unreadable, another version: calibrate anew)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(stored, dict) and stored.get("version") == CACHE_VERSION and isinstance(stored.get("layers"), list)
    return stored if ok else None


def chain_policy(depth: int, min_path_prob: float, width: int = 1) -> TreePolicy:
    return static_tree(spine_paths(depth, width), min_path_prob)


def calibrate_layer_skip(
    settings: InferJobConfig, target, kernels: bool, before: dict | None = None, out: TextIO = sys.stderr
) -> dict:
    """Measure, search and return the record to store (module docstring). `before`: the stored
    record it must beat."""
    check_layer_family(target)
    s, t = settings.skip, resolve_search(settings.tree)
    num_layers = len(target.layers)
    most = max(1, min(num_layers - 1, int(num_layers * s.max_share)))
    source, texts, prompts = calibration_prompts(settings, target.tokenizer)
    if not prompts:
        raise SpecHeadsError("skip.layers=auto needs at least one calibration prompt")
    cfg = sampling_config(settings, t.calibration_tokens, eos_token_ids(target))
    cfg.temperature = 0.0
    contexts = []
    for ids in tqdm(prompts, desc="layer skip: answers", unit="prompt", file=out):
        answer = hf_generate(target, torch.tensor([ids], device=target.device), cfg)["output_ids"]
        contexts.append((ids + answer, len(ids)))
    positions = sum(len(ids) - start - 1 for ids, start in contexts)
    needed = int(((before or {}).get("calibration") or {}).get("positions") or 0)
    if positions < needed:
        out.write(
            f"skip.layers=auto: {positions} answer positions are fewer than the {needed} the stored choice "
            "was calibrated on: too few to decide, it stays (give more tree.calibration_prompts or tokens)\n"
        )
        return before
    caches = [full_cache(target, ids) for ids, _ in contexts]
    vocab, coverage = answer_vocab(s.vocab_data, target, s.draft_vocab) if s.draft_vocab else (None, None)

    def along(skipped: Sequence[int], depth: int) -> list[Along]:
        return [draft_along(target, skipped, ids, st, depth, c, vocab) for (ids, st), c in zip(contexts, caches)]

    def agreement(alongs: Sequence[Along]) -> float:
        firsts = [m[0] for a in alongs for m in a.matches if m]
        return sum(firsts) / max(len(firsts), 1)

    alone = {}
    for i in tqdm(range(num_layers), desc="layer skip: each layer alone", unit="layer", file=out):
        alone[i] = agreement(along([i], 1))
    order = sorted(range(num_layers), key=lambda i: (-alone[i], i))
    # timed after the context tree=auto times at (step_context): speedups of both are comparable
    context = step_context([ids[:st] for ids, st in contexts], [ids for ids, _ in contexts])
    verify_s = time_target(target, context, range(1, s.depth * s.width + 2))
    rows = []
    candidates = [tuple(sorted(order[:m])) for m in range(1, most + 1)]
    old = tuple(before["layers"]) if before and before.get("layers") is not None else None
    if old is not None and before.get("vocab") != vocab:
        old = None  # drafted over another vocabulary: not a candidate of this one
    if old is not None and old not in candidates:
        candidates.append(old)
    walks: dict[tuple[int, ...], list[Along]] = {}
    for skipped in tqdm(candidates, desc="layer skip: skip sets", unit="set", file=out):
        check_skipped(num_layers, skipped)
        walks[skipped] = alongs = along(skipped, s.depth)
        level_s = time_level(target, skipped, context, vocab=vocab)
        row = {"layers": list(skipped), "agreement": agreement(alongs), "level_ms": 1e3 * level_s}
        rows.append(row | best_setting(alongs, level_s, verify_s, s.depth, s.width))
        if row["agreement"] < 0.05 and tuple(skipped) != old:
            break  # the drafts are no longer the target's: skipping more only loses
    # the fastest of many noisy timings is likely one timed too fast: the leaders are timed again,
    # FINALIST_REPEATS times each, and the choice is made on those timings
    for row in sorted(rows, key=lambda r: -r["tokens_per_s"])[:FINALISTS]:
        skipped = tuple(row["layers"])
        level_s = time_level(target, skipped, context, repeats=FINALIST_REPEATS, vocab=vocab)
        row |= {"level_ms": 1e3 * level_s, "retimed": True}
        row |= best_setting(walks[skipped], level_s, verify_s, s.depth, s.width)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    kept_old = old is not None and best["layers"] == list(old)
    out.write(
        f"layer skip ({positions} positions, {len(prompts)} prompts): plain step {1e3 * verify_s[1]:.1f} ms\n"
        "skipped  agree  level ms  depth  width  stop p   tau  expected   (* timed again)\n"
    )
    for r in rows:
        mark = " <" if r is best else ""
        out.write(
            f"{len(r['layers']):>7} {r['agreement']:>6.2f} {r['level_ms']:>8.1f}{'*' if r.get('retimed') else ' '} "
            f"{r['depth']:>6} {r['width']:>6} "
            f"{r['min_path_prob']:>7g} {r['tau']:>5.2f} {r['expected_speedup']:>8.2f}x{mark}\n"
        )
    if best["expected_speedup"] <= 1.0:
        out.write(
            f"layer skip: no skip set is expected to beat plain decoding on this machine (best "
            f"{best['expected_speedup']:.2f}x); stored anyway, as measured\n"
        )
    if kept_old:
        out.write("layer skip: the stored choice is still the best: it stays\n")
        return before
    return {
        "version": CACHE_VERSION,
        "layers": best["layers"],
        "depth": best["depth"],
        "width": best["width"],
        "min_path_prob": best["min_path_prob"],
        "vocab": vocab,
        "calibration": {
            "calibrated_at": utc_now(),
            "prompts": prompts_record(source, texts),
            "tokens": t.calibration_tokens,
            "positions": positions,
            "draft_vocab": {"data": s.vocab_data, "size": s.draft_vocab, "coverage": coverage} if vocab else None,
            "machine": machine_description(target.device, kernels),
            "plain_ms": 1e3 * verify_s[1],
            "alone": [alone[i] for i in range(num_layers)],
            "order": order,
            "candidates": rows,
            "expected_speedup": best["expected_speedup"],
        },
    }


def resolve_layer_skip(settings: InferJobConfig, target, kernels: bool, out: TextIO = sys.stderr) -> LayerSkip | None:
    """skip.layers as the drafter takes it: None (off); a list (those layers, drafting as the tree
    settings say: a chain of tree.depth, else 5); auto (this machine's stored choice: its layers,
    chain depth and stop probability, calibrated and stored first when there is none or
    skip.recalibrate asks)."""
    s = settings.skip
    if s.layers is None:
        return None
    if s.layers != "auto":
        layers = check_skipped(len(target.layers), s.layers)
        vocab = tuple(answer_vocab(s.vocab_data, target, s.draft_vocab)[0]) if s.draft_vocab else None
        return LayerSkip(layers, method_policy(None, settings.tree, "skip"), "given", vocab)
    path = skip_cache_path(target, kernels)
    stored = read_choice(path)
    if stored is None or s.recalibrate:
        record = calibrate_layer_skip(settings, target, kernels, stored, out)
        if record is not stored:
            write_json(path, record)
        stored, source = record, f"calibrated now, kept in {path}"
    else:
        source = f"this machine's calibration ({path}; skip.recalibrate=true calibrates again)"
    layers = check_skipped(len(target.layers), stored["layers"])
    depth, gate = int(stored["depth"]), float(stored["min_path_prob"])
    width = int(stored.get("width", 1))  # a choice stored before widths were weighed is a chain
    vocab = tuple(stored["vocab"]) if stored.get("vocab") else None
    beside = f" with {width - 1} alternative{'s' if width > 2 else ''} beside each node" if width > 1 else ""
    over = f" over {len(vocab)} tokens" if vocab else ""
    out.write(
        f"layer skip: skips layers {list(layers)}, a chain of {depth}{beside}{over} stopping under p {gate:g} "
        f"({source})\n"
    )
    return LayerSkip(layers, chain_policy(depth, gate, width), source, vocab)
