"""The Trainer: steps a DeepSpeed-wrapped head over a state source; checkpoints, evaluates, logs.

Only the head (with the target adapter that trains with it, Medusa-2's LoRA) goes through
`deepspeed.initialize` (ZeRO 0-3, gradient accumulation, clipping); the frozen target stays outside
it, and each rank reads its own shard of every global batch (specheads.train.batches).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from ..config.train import DeepSpeedConfig, HeadConfig, TrainConfig, TrainJobConfig
from ..data.datasets import row_lengths
from ..data.features import rows_digest
from ..distributed import Dist, all_gather_objects, all_reduce_sum, peak_memory_gb, per_rank
from ..errors import SpecHeadsError
from ..heads import save_head
from ..target import FLOAT_DTYPES
from .batches import eval_batches, training_order
from .checkpoint import Checkpoints
from .deepspeed_config import deepspeed_config, param_groups
from .metrics import MetricsLog
from .on_policy import OnPolicyStage, replay_loss
from .schedule import TimeBudget, warmup_cosine_scheduler
from .state_source import StateSource


class HeadObjective(nn.Module):
    """What DeepSpeed wraps: the head, with its loss and its evaluation as forward modes, and the
    target adapter that trains with it (so that it is optimized, clipped and checkpointed alike).

    Going through the engine's forward (not head.loss directly) lets ZeRO-3 gather parameters.
    """

    def __init__(self, head: nn.Module, autocast: torch.dtype | None = None):
        super().__init__()
        self.head = head
        self.autocast = autocast
        adapter = head.target_adapter()
        if adapter is not None:
            self.adapter = adapter

    def forward(self, batch, states, evaluate: bool = False, on_policy: bool = False):
        device = batch["input_ids"].device.type
        # mixed precision: matmuls in `autocast`, weights, optimizer and losses stay in the head's dtype
        with torch.autocast(device, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            if on_policy:  # replayed rows of the on-policy stage (train.on_policy)
                return replay_loss(self.head, batch, states)
            return self.head.evaluate(batch, states) if evaluate else self.head.loss(batch, states)


def initialize(head: nn.Module, t: TrainConfig, z: DeepSpeedConfig, d: Dist, total_steps: int):
    """deepspeed.initialize on the head (and its target adapter) only. Returns the engine."""
    import deepspeed

    head_dtype = next(head.parameters()).dtype
    objective = HeadObjective(head, autocast_dtype(t.autocast, head_dtype))
    warn_if_emulated(objective.autocast, d.device)
    config = deepspeed_config(t, z, d.world_size, d.device, head_dtype)
    adapter, adapter_lr = head.target_adapter(), head.target_adapter_lr()
    own_lr = (adapter, adapter_lr) if adapter is not None and adapter_lr is not None else None
    groups = param_groups(objective, t.weight_decay, own_lr)
    optimizer = None
    if "optimizer" not in config:
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)

    def scheduler(opt):
        return warmup_cosine_scheduler(opt, t.warmup_steps, total_steps, t.min_lr_ratio)

    engine, *_ = deepspeed.initialize(
        model=objective,
        optimizer=optimizer,
        model_parameters=groups if optimizer is None else None,
        lr_scheduler=scheduler,
        config=config,
    )
    return engine


def autocast_dtype(name: str | None, head_dtype: torch.dtype) -> torch.dtype | None:
    """train.autocast: null (none), bfloat16 or float16; refused over a head already in low precision."""
    if name is None:
        return None
    if name not in ("bfloat16", "float16"):
        raise SpecHeadsError(f"train.autocast must be null, bfloat16 or float16, got {name!r}")
    if head_dtype != torch.float32:
        raise SpecHeadsError(
            f"train.autocast={name} mixes precisions over float32 weights, but the head trains in {head_dtype} "
            "(the target's dtype): load the target in float32 (model.dtype=float32) or drop train.autocast"
        )
    return FLOAT_DTYPES[name]


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as torch detects it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: True)() for name in checks)


def warn_if_emulated(dtype: torch.dtype | None, device) -> None:
    """bf16 autocast on a CPU without bf16 instructions is emulated: 2.5x slower than float32 on a
    2-core AVX-512 Xeon (BENCHMARKS.md), where it was 2.4x faster on a CPU that has them."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_bf16():
        print(
            "train: train.autocast=bfloat16 on a CPU without bf16 instructions (AVX512-BF16, AMX) is "
            "emulated and slower than float32 here: drop train.autocast",
            file=sys.stderr,
        )


# what OUTPUT_DIR/best is chosen by: the simulated acceptance length on the evaluation split
BEST_METRIC = "eval/sim_tau"
BEST_DIR = "best"

# fingerprint keys a checkpoint written before them lacks: not compared there (its train_rows still is)
ADDED_LATER = ("train_data", "group_by_length")
# fingerprint keys a checkpoint written before them lacks, with the value its run had
ADDED_LATER_AS = {"pack": None}


def fingerprint_diffs(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's run and this one. A head field that a later version
    added (absent from the checkpoint) counts only when it is set away from its default."""
    defaults = asdict(HeadConfig())
    diffs = []
    for key, value in now.items():
        if key in ADDED_LATER and key not in saved:
            continue
        old = saved.get(key, ADDED_LATER_AS.get(key))
        if key == "head" and isinstance(old, dict) and isinstance(value, dict):
            old = {**{k: v for k, v in defaults.items() if k in value}, **old}
        if old != value:
            diffs.append(f"{key} {saved.get(key, ADDED_LATER_AS.get(key))!r} -> {value!r}")
    return diffs


def optimizer_settings(engine) -> dict[str, Any]:
    """What restoring a checkpoint's optimizer and schedule puts back, under its train.* name (the
    schedule's length is left out: retarget_schedule honours a new one)."""
    scheduler = engine.lr_scheduler
    schedule = scheduler.lr_lambdas[0]
    group = scheduler.optimizer.param_groups[0]  # the head's decayed matrices (param_groups)
    return {
        "train.lr": scheduler.base_lrs[0],
        "train.warmup_steps": getattr(schedule, "warmup_steps", None),
        "train.min_lr_ratio": getattr(schedule, "min_lr_ratio", None),
        "train.betas": list(group.get("betas", ())),
        "train.weight_decay": group.get("weight_decay"),
    }


class Trainer:
    """Steps a DeepSpeed-wrapped head over a StateSource; checkpoints, evaluates, logs."""

    def __init__(self, cfg: TrainJobConfig, head: nn.Module, source: StateSource, d: Dist, output_dir: Path):
        self.cfg, self.head, self.source, self.d = cfg, head, source, d
        self.output_dir = output_dir
        t = cfg.train  # its values were checked by train.run.check_train_settings
        source.require(*head.training_states())
        lengths = row_lengths(source.rows("train"))
        # data.pack: the rows a micro-batch reads are packs of conversations (a pure function of
        # their lengths, so a resumed run packs alike); None: one conversation per row
        self.packs, self.batches = training_order(cfg, lengths, d.rank, d.world_size)
        if self.packs is not None and d.is_main:
            full = sum(lengths) / max(1, len(self.packs) * cfg.data.max_length)
            print(
                f"data: {len(lengths)} training conversations packed into {len(self.packs)} rows of up to "
                f"{cfg.data.max_length} tokens ({full:.0%} full)",
                file=sys.stderr,
            )
        eval_rows = source.rows("eval")
        self.eval_batches = (
            eval_batches(row_lengths(eval_rows), t.batch_size, d.rank, d.world_size, max_batches=t.eval_batches)
            if len(eval_rows)
            else []
        )
        self.data_digest = rows_digest(source.rows("train"))
        self.max_steps = self.total_steps()
        self.engine = initialize(head, t, cfg.deepspeed, d, self.max_steps)
        self.checkpoints = Checkpoints(output_dir, t.keep_checkpoints, d.rank, d.world_size)
        self.step = 0
        self.last_eval: dict[str, float] = {}
        # {"metric", "value", "step"} of the head kept in OUTPUT_DIR/best (None before an evaluation);
        # kept in every checkpoint, so a resumed run compares against it
        self.best: dict[str, Any] | None = None
        # who trains: this process's code and command (set by train(cfg)); a resumed run also
        # carries who trained it before, from its checkpoint, so its head names every segment
        self.origin: dict[str, Any] = {}
        self.earlier_segments: list[dict[str, Any]] = []
        self.resumed_at = 0
        # what train.init_from started this run from ({} for none): set by train(cfg) at the first
        # start and kept in every checkpoint, since a resume reads its weights from the checkpoint;
        # None after resuming a checkpoint written before checkpoints kept it
        self.init_record: dict[str, Any] | None = {}
        # the training record a head directory written at a checkpoint carries (train.save_heads);
        # set by train(cfg), which owns the run's provenance
        self.head_record: Callable[[Trainer], dict[str, Any]] | None = None
        # the on-policy stage (train.on_policy), attached by train(cfg) when it is on; None: the
        # supervised loss alone, as every run without the stage trains
        self.on_policy: OnPolicyStage | None = None

    def total_steps(self) -> int:
        t = self.cfg.train
        if t.epochs is not None:
            micro = t.epochs * self.batches.batches_per_epoch
            return max(1, math.ceil(micro / t.grad_accum))
        return t.max_steps

    # -- resume ----------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What must match for a checkpoint to continue this run."""
        c = self.cfg
        return {
            "model": c.model.path,
            "head": asdict(c.head),
            "batch_size": c.train.batch_size,
            "grad_accum": c.train.grad_accum,
            "world_size": self.d.world_size,
            "seed": c.seed,
            **({"data_seed": c.data_seed} if c.data_seed is not None else {}),  # older checkpoints lack it
            "train_rows": len(self.source.rows("train")),
            # the rows the step count indexes, by what they hold, and the order they are batched in
            "train_data": self.data_digest,
            "group_by_length": c.train.group_by_length,
            "init_from": c.train.init_from,
            # the packed rows' length (data.pack), None: one conversation per row
            "pack": c.data.max_length if c.data.pack else None,
        }

    def resume(self) -> int:
        self.checkpoints.remove_partial()
        latest = self.checkpoints.latest()
        if latest is None:
            return 0
        configured = optimizer_settings(self.engine)
        state = self.checkpoints.load(self.engine, latest)
        diffs = fingerprint_diffs(state.get("fingerprint", {}), self.fingerprint())
        if diffs:
            raise SpecHeadsError(
                f"{self.output_dir} holds a checkpoint of a different run ({'; '.join(diffs)}); use a new output_dir"
            )
        restored = optimizer_settings(self.engine)
        changed = [f"{k} {restored[k]!r} -> {v!r}" for k, v in configured.items() if restored[k] != v]
        if changed:
            raise SpecHeadsError(
                f"{latest} restores its own optimizer settings, so this run's would be ignored ({'; '.join(changed)}): "
                "set them back to resume, or use a new output_dir"
            )
        self.step = int(state["step"])
        self.last_eval = state.get("last_eval", {})
        # a best/ that the interrupted run wrote after this checkpoint is rewritten as its steps are redone
        self.best = state.get("best")
        self.init_record = state.get("init_record")
        # a checkpoint written before checkpoints named their segments: its steps' code is unknown
        self.earlier_segments = state.get("segments") or [{"steps": [0, self.step], "commit": None, "command": None}]
        self.resumed_at = self.step
        self.retarget_schedule()
        return self.step

    def segments(self) -> list[dict[str, Any]]:
        """[{"steps": [from, to], commit, command, ...}] for every process that trained this run."""
        return [*self.earlier_segments, {"steps": [self.resumed_at, self.step], **self.origin}]

    def retarget_schedule(self) -> None:
        """A resumed run whose step count changed (train.max_steps / epochs) decays its learning rate
        to the new end; the restored scheduler would otherwise keep the old curve."""
        schedule = getattr(self.engine.lr_scheduler, "lr_lambdas", [None])[0]
        old = getattr(schedule, "total_steps", None)
        if old is not None and old != self.max_steps:
            schedule.total_steps = self.max_steps
            if self.d.is_main:
                print(
                    f"train: the learning-rate schedule now ends at step {self.max_steps} (was {old})", file=sys.stderr
                )

    def save(self) -> None:
        self.checkpoints.save(
            self.engine,
            self.step,
            {
                "step": self.step,
                "micro_batches": self.step * self.cfg.train.grad_accum,
                "fingerprint": self.fingerprint(),
                "last_eval": self.last_eval,
                "best": self.best,
                "segments": self.segments(),
                "init_record": self.init_record,
            },
        )

    # -- steps -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step: grad_accum micro-batches of this rank's shard."""
        grad_accum = self.cfg.train.grad_accum
        sums: dict[str, float] = {}
        tokens = 0
        self.head.steps_done = self.step
        if self.on_policy is not None and self.on_policy.due(self.step):
            self.on_policy.refresh(self.engine, self.step)
        for k in range(grad_accum):
            rows = self.batches[self.step * grad_accum + k]
            if self.packs is None:
                batch, states = self.source.fetch("train", rows)
            else:
                batch, states = self.source.fetch_packed("train", [self.packs[i] for i in rows])
            if self.on_policy is None:
                loss, metrics = self.engine(batch, states)
            else:
                loss, metrics, on_policy_tokens = self.on_policy.loss(self.engine, batch, states)
                tokens += on_policy_tokens
            self.engine.backward(loss)
            self.engine.step()
            for key, value in {"loss": loss.item(), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value) / grad_accum
            tokens += int(batch["attention_mask"].sum())
        self.step += 1
        sums["tokens"] = float(tokens)
        return sums

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Eval loss, top-1 accuracy per draft depth and simulated acceptance length, all ranks."""
        if not self.eval_batches:
            return {}
        self.head.steps_done = self.step
        self.engine.eval()
        loss_sum, loss_n, accept_sum, accept_n = 0.0, 0, 0.0, 0
        correct = total = None
        devices = [self.d.device.index or 0] if self.d.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # evaluation must not move the training RNG
            for rows in self.eval_batches:
                batch, states = self.source.fetch("eval", rows)
                loss, _ = self.engine(batch, states)
                result = self.engine(batch, states, evaluate=True)
                loss_sum += loss.item()
                loss_n += 1
                c, n = result["correct"].double().cpu(), result["total"].double().cpu()
                correct = c if correct is None else correct + c
                total = n if total is None else total + n
                accept_sum += float(result["accept_lengths"].sum())
                accept_n += int(result["accept_lengths"].numel())
        self.engine.train()
        packed = torch.cat(
            [torch.tensor([loss_sum, loss_n, accept_sum, accept_n], dtype=torch.float64), correct, total]
        ).to(self.d.device)
        packed = all_reduce_sum(packed).cpu()
        depth = correct.numel()
        out = {
            "eval/loss": float(packed[0] / packed[1].clamp(min=1)),
            "eval/sim_tau": 1.0 + float(packed[2] / packed[3].clamp(min=1)),
        }
        for i in range(depth):
            out[f"eval/acc_{i}"] = float(packed[4 + i] / packed[4 + depth + i].clamp(min=1))
        return out

    def _reduce_train_metrics(self, window: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted(window[0])
        local = torch.tensor([sum(m.get(k, 0.0) for m in window) for k in keys], dtype=torch.float64)
        summed = all_reduce_sum(local.to(self.d.device)).cpu()
        out = {}
        for k, v in zip(keys, summed.tolist()):
            out[f"train/{k}"] = v if k == "tokens" else v / (len(window) * self.d.world_size)
        return out

    def fit(self, log: MetricsLog) -> dict[str, float]:
        t = self.cfg.train
        start = self.step
        bar = tqdm(
            total=self.max_steps,
            initial=start,
            desc="train",
            disable=not self.d.is_main,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        window: list[dict[str, float]] = []
        postfix: dict[str, str] = {}
        window_start = time.perf_counter()
        budget = None if t.max_minutes is None else TimeBudget(t.max_minutes, first_step=start)
        self.engine.train()
        try:  # the bar ends its line also when a step fails, so the error line stands alone
            while self.step < self.max_steps:
                window.append(self.train_step())
                bar.update(1)
                last = self.step == self.max_steps or (budget is not None and self.follow_budget(budget, bar))
                if self.step % max(1, t.log_every) == 0 or last:
                    metrics = self._reduce_train_metrics(window)
                    elapsed = time.perf_counter() - window_start
                    metrics["train/tokens_per_s"] = metrics.pop("train/tokens") / elapsed
                    metrics["train/steps_per_s"] = len(window) / elapsed
                    metrics["train/lr"] = float(self.engine.get_lr()[0])
                    grad_norm = self.engine.get_global_grad_norm()
                    if grad_norm is not None:
                        metrics["train/grad_norm"] = float(grad_norm)
                    metrics["train/epoch"] = self.step * t.grad_accum / self.batches.batches_per_epoch
                    peaks = per_rank(peak_memory_gb(self.d.device), self.d)
                    metrics.update({f"train/peak_mem_gb/rank{r}": gb for r, gb in enumerate(peaks)})
                    log.log(self.step, metrics)
                    postfix.update(
                        loss=f"{metrics['train/loss']:.3f}",
                        lr=f"{metrics['train/lr']:.2e}",
                        tok_s=f"{metrics['train/tokens_per_s']:.0f}",
                        peak_mem=f"{max(peaks):.1f}GB",
                    )
                    bar.set_postfix(postfix)
                    window, window_start = [], time.perf_counter()
                if (t.eval_every > 0 and self.step % t.eval_every == 0) or last:
                    self.last_eval = self.evaluate()
                    if self.last_eval:
                        log.log(self.step, self.last_eval)
                        self.keep_if_best()  # before the checkpoint below, which then records it
                        postfix["sim_tau"] = f"{self.last_eval['eval/sim_tau']:.2f}"
                        bar.set_postfix(postfix)
                if (t.save_every > 0 and self.step % t.save_every == 0) or last:
                    self.save()
                    if t.save_heads and self.head_record is not None:
                        self.write_head(self.output_dir / "heads" / f"step-{self.step}", self.head_record(self))
                if last:
                    break
        finally:
            bar.close()
        return self.last_eval

    def keep_if_best(self) -> bool:
        """Writes the head to OUTPUT_DIR/best when this evaluation beats every earlier one of the run
        (strictly: on a tie the earlier head stays). All ranks hold the same reduced evaluation, so
        all decide alike and meet in write_head."""
        value = self.last_eval.get(BEST_METRIC)
        if value is None or not math.isfinite(value):
            return False
        if self.best is not None and value <= self.best["value"]:
            return False
        self.best = {"metric": BEST_METRIC, "value": float(value), "step": self.step}
        if self.head_record is not None:
            # the merged target (head.merge_lora) pairs with the last head, OUTPUT_DIR/head
            self.write_head(self.output_dir / BEST_DIR, self.head_record(self), merge_target=False)
        return True

    def follow_budget(self, budget: TimeBudget, bar: tqdm) -> bool:
        """True once train.max_minutes is spent; meanwhile ends the cosine where the budget will.
        Rank 0's clock decides for all ranks, so every rank stops at the same step with the same
        learning rates."""
        spent, end = (float(budget.spent()), float(budget.projected_end(self.step, self.max_steps) or 0))
        if not self.d.is_main:
            spent, end = 0.0, 0.0
        spent, end = all_reduce_sum(torch.tensor([spent, end], dtype=torch.float64, device=self.d.device)).tolist()
        schedule = getattr(self.engine.lr_scheduler, "lr_lambdas", [None])[0]
        if end > 0 and schedule is not None:
            schedule.total_steps = int(end)
            bar.total = int(end)
        return spent > 0

    def agreed_weights_digest(self) -> str:
        """The digest of the head's trained weights, after checking that every rank holds the same
        (data parallelism must leave them identical; a rank that drifted means a broken reduction)."""
        digest = hashlib.sha256()
        for name, p in sorted(self.engine.module.named_parameters()):
            if p.requires_grad:
                digest.update(name.encode())
                digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        digests = all_gather_objects(digest.hexdigest())
        if len(set(digests)) > 1:
            differ = [r for r, x in enumerate(digests) if x != digests[0]]
            raise SpecHeadsError(f"after training, rank(s) {differ} hold head weights different from rank 0's")
        return digests[0]

    def write_head(self, directory: Path, training: dict[str, Any], merge_target: bool = True) -> Path:
        """Rank 0 writes the head (gathering ZeRO-3 shards first), and with head.merge_lora (and
        merge_target) the adapted target beside it (OUTPUT_DIR/merged); every rank returns the head's path."""
        gathered = contextlib.nullcontext()
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)
        with gathered:
            training = {**training, "trained_weights_sha256": self.agreed_weights_digest()}
            if self.d.is_main:
                save_head(self.head, directory, training=training, dtype=FLOAT_DTYPES.get(self.cfg.save_dtype))
                if self.head.spec.merge_lora and merge_target:
                    self.head.save_merged_target(self.output_dir / "merged", directory)
        dist.barrier()
        return directory
