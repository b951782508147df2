"""On-policy distillation of an EAGLE-3 head (Draft-OPD, Lei et al. 2026, arXiv 2605.29343):
`train.on_policy` (OnPolicyConfig).

A head trained on the target's fixed trajectories is judged at inference on the states its own
proposals lead to. This stage trains it there:

1. rollouts: our own speculative loop (decode.generate.speculative_generate) with the current head,
   drafting a chain of head.ttt_steps, and the frozen target, on training prompts (each training
   row up to its first assistant token). The output is the target's own, lossless as always; every
   verification is recorded (`Recorder`): what the head drafted below the round's root and what
   the verification committed, hence the position of the first rejected draft (`Verification`).
2. replay: from each rejection position r, the head drafts `draft_steps` tokens over its own
   proposals, with its own drafter (decode.drafters.EagleDrafter, a chain), as at inference: the
   committed prefix seq[:r] is fed with the target's states, its last token is the root, and each
   drafted token and fed-back feature is the head's own (`replay_rows`). A replayed row is the
   prefix followed by the head's drafted tokens, the drafted positions marked in its loss_mask.
3. loss: the target is run on each row (the prefix and the head's drafted tokens, an OnlineStates
   forward); the head's training-time-test unroll over the row at the root's position is its chain
   draft over its own tokens (step j reads the j-th drafted token and its own step j-1 output), and
   each step's draft distribution is held to the target's at that state (Eagle3Head.step_loss:
   head.loss_fn over the draft vocabulary, as the supervised loss; `replay_loss`).

Rollouts are refreshed every `refresh_every` steps with the head of the moment and kept in memory
in between; each optimizer step's loss is (1 - mix) x the supervised loss + mix x the on-policy
loss (`OnPolicyStage`). Each rank rolls out its own share of the prompts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..config.train import OnPolicyConfig, TrainJobConfig
from ..decode.drafters import make_drafter
from ..decode.generate import GenerationResult, SamplingConfig, speculative_generate
from ..decode.tree import chain_paths, static_tree
from ..errors import SpecHeadsError
from ..target import FrozenTarget, eos_token_ids
from .state_source import Batch, OnlineStates, States

SUPPORTED_FAMILIES = ("eagle3",)
SPLIT = "on_policy"  # the replayed rows' split in the stage's OnlineStates


# -- settings ----------------------------------------------------------------------------------
def check_settings(cfg: TrainJobConfig) -> None:
    """The train.on_policy values no run can start with, refused in one line before anything loads."""
    o = cfg.train.on_policy
    if not o.enabled:
        return
    limits = [
        (cfg.head.family in SUPPORTED_FAMILIES, f"train.on_policy trains head=eagle3 only, got head={cfg.head.family}"),
        (0 <= o.mix <= 1, f"train.on_policy.mix must be in [0, 1], got {o.mix}"),
        (o.refresh_every >= 1, f"train.on_policy.refresh_every must be >= 1, got {o.refresh_every}"),
        (o.rollouts >= 1, f"train.on_policy.rollouts must be >= 1, got {o.rollouts}"),
        (o.max_new_tokens >= 2, f"train.on_policy.max_new_tokens must be >= 2, got {o.max_new_tokens}"),
        (o.temperature >= 0, f"train.on_policy.temperature must be >= 0, got {o.temperature}"),
        (o.draft_steps is None or o.draft_steps >= 1, f"train.on_policy.draft_steps must be >= 1, got {o.draft_steps}"),
    ]
    for ok, message in limits:
        if not ok:
            raise SpecHeadsError(message)


def draft_steps(o: OnPolicyConfig, head) -> int:
    return o.draft_steps if o.draft_steps is not None else head.spec.ttt_steps


def chain_drafter(head, depth: int):
    """The head's own inference drafter, drafting a chain of `depth` tokens (its top-1 at each)."""
    return make_drafter(head, static_tree(chain_paths(depth)))


def prompts_of(rows: Sequence[dict]) -> list[list[int]]:
    """Each training row up to its first assistant token (rows without one are left out)."""
    out = []
    for row in rows:
        first = next((i for i, m in enumerate(row["loss_mask"]) if m), None)
        if first:
            out.append(list(row["input_ids"][:first]))
    return out


# -- 1. rollouts -------------------------------------------------------------------------------
@dataclass
class Verification:
    """One verification of a rollout's chain."""

    root: int  # the round's root token's index in the sequence (the committed prefix's length)
    drafted: list[int]  # the chain the head drafted below the root
    committed: list[int]  # what the verification committed after the root: accepted drafts, target's token

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted: the committed tokens agree with the draft up to the first
        rejection, where the target's own token differs from the draft (greedy: its argmax; sampled:
        a residual that excludes the drafted token)."""
        n = 0
        while n < min(len(self.drafted), len(self.committed)) and self.drafted[n] == self.committed[n]:
            n += 1
        return n

    @property
    def rejection(self) -> int | None:
        """The sequence index of the first rejected draft, None when none was rejected there (every
        drafted token accepted, or the generation ended before the target's token was committed)."""
        a = self.accepted
        return self.root + 1 + a if a < len(self.drafted) and a < len(self.committed) else None


class Recorder:
    """The head's drafter in a rollout, recording every verification (what was drafted below which
    root, what the verification then committed); drafting itself is the drafter's own."""

    def __init__(self, inner):
        self.inner = inner
        self.layer_ids, self.reads_final = inner.layer_ids, inner.reads_final
        self.verifications: list[Verification] = []
        self.pending: tuple[int, list[int]] | None = None

    def start(self, prompt_ids, states, root):
        self.inner.start(prompt_ids, states, root)

    def draft(self, root, prefix_len, max_depth):
        tokens, layout = self.inner.draft(root, prefix_len, max_depth)
        self.pending = (prefix_len, list(tokens[1:]))  # a chain: node order is depth order
        return tokens, layout

    def _record(self, committed: list[int]) -> None:
        root, drafted = self.pending
        self.verifications.append(Verification(root, drafted, [int(t) for t in committed]))

    def advance(self, states, tokens, bonus):
        self._record([*tokens[1:], bonus])
        self.inner.advance(states, tokens, bonus)

    def finish(self, tokens):  # the last step, which no advance() follows
        self._record(list(tokens))


@dataclass
class Rollout:
    prompt: list[int]
    result: GenerationResult  # output_ids: the target's own tokens
    verifications: list[Verification] = field(default_factory=list)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.result.output_ids

    def rejections(self) -> list[int]:
        """Sequence indices of the first rejected draft of each verification that rejected one."""
        return [r for r in (v.rejection for v in self.verifications) if r is not None]


def rollout(head, target: FrozenTarget, prompt: Sequence[int], cfg: SamplingConfig, generator=None) -> Rollout:
    """speculative_generate with the head's chain of head.ttt_steps on `prompt`, every verification recorded."""
    recorder = Recorder(chain_drafter(head, head.spec.ttt_steps))
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=target.device)
    result = speculative_generate(target, recorder, ids, cfg, generator=generator)
    return Rollout(list(prompt), result, recorder.verifications)


# -- 2. replay ---------------------------------------------------------------------------------
def drafter_states(target: FrozenTarget, drafter, ids: torch.Tensor) -> dict[Any, torch.Tensor]:
    """The target's states over ids [1, T] that the drafter reads, as the generation loop captures them."""
    captured = target.states(ids, layer_ids=drafter.layer_ids, final=drafter.reads_final)
    return {**captured.hidden, **({"final": captured.final} if drafter.reads_final else {})}


def _span(states: dict, start: int, end: int) -> dict:
    return {k: v[:, start:end] for k, v in states.items()}


@torch.no_grad()
def replay_drafts(head, target: FrozenTarget, sequence: Sequence[int], positions: Sequence[int], steps: int):
    """For each rejection position r (ascending, >= 2): the `steps` tokens the head drafts from the
    prefix sequence[:r] over its own proposals, with its own chain drafter as at inference (the
    prefix's last token the root, the prefix fed with the target's states). One drafter walks the
    sequence, fed the committed tokens between positions as decoding feeds it."""
    if not positions:
        return []
    seq = [int(t) for t in sequence]
    drafter = chain_drafter(head, steps)
    ids = torch.tensor([seq[: positions[-1]]], dtype=torch.long, device=target.device)
    states = drafter_states(target, drafter, ids)
    first = positions[0]
    drafter.start(ids[:, : first - 1], _span(states, 0, first - 1), seq[first - 1])
    drafts, previous = [], first
    for r in positions:
        if r != previous:  # the tokens committed since the last root, root first; the next root
            drafter.advance(_span(states, previous - 1, r - 1), seq[previous - 1 : r - 1], seq[r - 1])
            previous = r
        tokens, _ = drafter.draft(seq[r - 1], r - 1, max_depth=steps)
        drafts.append([int(t) for t in tokens[1:]])
    return drafts


def replay_rows(head, target: FrozenTarget, ro: Rollout, steps: int) -> list[dict]:
    """One training row per rejection of the rollout: the prefix before it, then the head's own
    `steps` drafted tokens from there; loss_mask marks the drafted positions."""
    positions = [r for r in ro.rejections() if r >= 2]  # the root's feature is the target's at r - 2
    seq = ro.sequence
    rows = []
    for r, drafted in zip(positions, replay_drafts(head, target, seq, positions, steps)):
        rows.append({"input_ids": seq[:r] + drafted, "loss_mask": [0] * r + [1] * len(drafted)})
    return rows


# -- 3. loss -----------------------------------------------------------------------------------
def replayed_steps(head, batch: Batch, states: States):
    """Per drafted step j: (rows b, the root's draft position t, the head's step-j outputs [N, H],
    the target's logits [N, V] at those states). A row's first drafted position r is its loss_mask's
    first 1; its draft runs at t = r - 2 (the root at r - 1 reads the target's feature at r - 2), and
    the unroll's step j there reads the row's token r - 1 + j (the head's (j)-th drafted one) and its
    own step j - 1 output, predicting token r + j: the target's distribution for it is its logits at
    r - 1 + j, computed on the prefix and the head's drafted tokens."""
    mask = batch["loss_mask"].bool()
    drafted = mask.sum(1)
    t = mask.int().argmax(1) - 2
    outs = head.unrolled_batch(batch, head.input_features(states), int(drafted.max()))
    rows = torch.arange(mask.shape[0], device=mask.device)
    for j, h in enumerate(outs):
        live = drafted > j
        b, tb = rows[live], t[live]
        yield b, tb, h[b, tb], head.target_logits(states["final"][b, tb + 1 + j])


def replay_loss(head, batch: Batch, states: States) -> tuple[torch.Tensor, dict[str, float]]:
    """The on-policy loss: step j's head.loss_fn against the target at the replayed states (the
    supervised loss's own step, Eagle3Head.step_loss), weighted head.ttt_decay^j as it weights them."""
    total, metrics = None, {}
    for j, (_, _, h, target_logits) in enumerate(replayed_steps(head, batch, states)):
        loss_j, acc = head.step_loss(h, target_logits)
        term = head.spec.ttt_decay**j * loss_j
        total = term if total is None else total + term
        metrics[f"on_policy_acc_{j}"] = acc.item()
    return total, metrics


# -- the stage ---------------------------------------------------------------------------------
class OnPolicyStage:
    """Rollouts refreshed every refresh_every steps, their replayed rows cached in memory, and each
    micro-batch's loss mixed with the on-policy loss of the next batch of them."""

    def __init__(self, cfg: TrainJobConfig, head, target: FrozenTarget, prompts: list[list[int]], d, autocast=None):
        self.o = cfg.train.on_policy
        self.head, self.target, self.prompts, self.d = head, target, prompts, d
        self.seed, self.batch_size = cfg.seed, cfg.train.batch_size
        self.steps = draft_steps(self.o, head)
        self.rows: list[dict] = []
        self.source = OnlineStates(target, {SPLIT: self.rows}, target.tokenizer.pad_token_id, autocast)
        self.source.require(*head.training_states())
        self.order: list[int] = []
        self.cursor = 0
        self.refreshed_at: int | None = None
        self.stats: dict[str, float] = {}
        if not prompts:
            raise SpecHeadsError("train.on_policy: no training row has an assistant token to roll out from")

    def sampling(self) -> SamplingConfig:

        return SamplingConfig(
            max_new_tokens=self.o.max_new_tokens,
            temperature=self.o.temperature,
            eos_token_ids=eos_token_ids(self.target),
        )

    def due(self, step: int) -> bool:
        return self.refreshed_at is None or step % self.o.refresh_every == 0

    def chosen_prompts(self, step: int) -> list[list[int]]:
        """This rank's share of the refresh's prompts: a seeded sample of o.rollouts, the same on every rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        chosen = torch.randperm(len(self.prompts), generator=g)[: self.o.rollouts].tolist()
        return [self.prompts[i] for i in chosen[self.d.rank :: self.d.world_size]]

    @torch.no_grad()
    def refresh(self, engine, step: int) -> None:
        """Roll out with the head of this step and replace the cached rows by their replays."""
        engine.eval()
        cfg = self.sampling()
        generator = torch.Generator(device=self.target.device).manual_seed(self.seed * 7919 + step * 31 + self.d.rank)
        prompts = self.chosen_prompts(step)
        rows, drafted, accepted, forwards, emitted = [], 0, 0, 0, 0
        bar = tqdm(
            prompts, desc=f"on-policy rollouts (step {step})", disable=not self.d.is_main, leave=False, file=sys.stderr
        )
        with gathered(engine), _fork_rng(self.target.device):
            for prompt in bar:
                ro = rollout(self.head, self.target, prompt, cfg, generator)
                rows.extend(replay_rows(self.head, self.target, ro, self.steps))
                drafted += sum(len(v.drafted) for v in ro.verifications)
                accepted += sum(v.accepted for v in ro.verifications)
                forwards += ro.result.target_forwards
                emitted += max(0, ro.result.new_tokens - 1)
        bar.close()
        engine.train()
        self.rows[:] = rows  # the OnlineStates reads this very list
        g = torch.Generator().manual_seed(self.seed * 104_729 + step)
        self.order, self.cursor = torch.randperm(len(rows), generator=g).tolist(), 0
        self.refreshed_at = step
        self.stats = {
            "rollout_tau": emitted / forwards if forwards else 1.0,  # tokens per verification
            "rollout_acceptance": accepted / drafted if drafted else 0.0,  # accepted share of the drafted tokens
            "on_policy_cached_rows": float(len(rows)),
        }

    def next_batch(self) -> tuple[Batch, States]:
        take = []
        while len(take) < min(self.batch_size, len(self.order)):
            if self.cursor == len(self.order):
                self.cursor = 0
            take.append(self.order[self.cursor])
            self.cursor += 1
        return self.source.fetch(SPLIT, take)

    def loss(self, engine, batch: Batch, states: States) -> tuple[torch.Tensor, dict[str, float], int]:
        """(the micro-batch's mixed loss, its metrics, the on-policy tokens it read). The supervised
        loss always runs (weight 1 - mix, or 1 where this rank's rollouts left no rejection), so every
        rank's backward reaches every parameter and logs the same keys."""
        supervised, metrics = engine(batch, states)
        share, on_loss, tokens, rows = 0.0, 0.0, 0, 0.0
        loss = supervised
        if self.order:
            on_batch, on_states = self.next_batch()
            on_policy, on_metrics = engine(on_batch, on_states, on_policy=True)
            share, on_loss = self.o.mix, on_policy.item()
            loss = (1.0 - share) * supervised + share * on_policy
            metrics = {**metrics, **on_metrics}
            tokens = int(on_batch["attention_mask"].sum())
            rows = on_batch["input_ids"].shape[0] / (on_batch["input_ids"].shape[0] + batch["input_ids"].shape[0])
        metrics.update(
            supervised_loss=supervised.item(),
            on_policy_loss=on_loss,
            on_policy_share=share,  # the share of this loss that is on-policy
            on_policy_row_share=rows,  # the share of the rows it read that were replayed ones
            **self.stats,
        )
        for j in range(self.steps):  # the same keys on every rank and step
            metrics.setdefault(f"on_policy_acc_{j}", 0.0)
        return loss, metrics, tokens


@contextlib.contextmanager
def gathered(engine):
    """The head's whole parameters for drafting outside the engine's forward (ZeRO-3 partitions them)."""
    if engine.zero_optimization_stage() != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield


def _fork_rng(device: torch.device):
    """Rollouts leave torch's global RNG where training left it (their sampling has its own generator)."""
    devices = [device.index or 0] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def build_stage(cfg: TrainJobConfig, head, target: FrozenTarget, train_rows: Sequence[dict], d, autocast=None):
    """The stage train.py attaches to its Trainer, or None when train.on_policy is off."""
    if not cfg.train.on_policy.enabled:
        return None
    return OnPolicyStage(cfg, head, target, prompts_of(train_rows), d, autocast)
