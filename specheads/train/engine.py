"""Training: the frozen target on every rank, the draft head wrapped by DeepSpeed, one train_step.

One code path serves one process (CPU or GPU) and N processes started by `deepspeed train.py` or
`torchrun`: the distributed backend is always initialised (gloo on CPU, nccl on GPU), only the
head goes through `deepspeed.initialize` (ZeRO 0-3, gradient accumulation, clipping), and each
rank reads its own shard of every global batch (specheads.train.batches). Target states come from a
StateSource (online target forwards here; offline feature caches plug into the same seam).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from .batches import TrainBatches, eval_batches
from .checkpoint import Checkpoints
from ..errors import SpecHeadsError
from .metrics import MetricsLog, plot_metrics
from .schedule import warmup_cosine_scheduler
from .state_source import OnlineStates, StateSource, row_lengths


# -- distributed setup -----------------------------------------------------------------------

@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(device_name: str = "auto") -> Dist:
    """Initialise torch.distributed through DeepSpeed, also for a single plain process."""
    if device_name not in ("auto", "cpu", "cuda"):
        raise SpecHeadsError(f"device must be auto, cpu or cuda, got {device_name!r}")
    use_cuda = torch.cuda.is_available() if device_name == "auto" else device_name == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SpecHeadsError("device=cuda asked for, but no CUDA device is available")
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported
    if "WORLD_SIZE" not in os.environ:  # a plain `python train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not use_cuda and int(os.environ["WORLD_SIZE"]) == 1:
        _skip_shm_comm_op()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False,
                                   verbose=False)
    return Dist(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=device)


def _skip_shm_comm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (about a minute in a
    fresh environment) that only ranks sharing a machine use; a world of one has no peers."""
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError, TypeError):  # another DeepSpeed layout: build it as usual
        pass


@contextlib.contextmanager
def main_rank_first(d: Dist):
    """Rank 0 runs the block first (it may build and cache data); the others then reuse its cache."""
    if not d.is_main:
        dist.barrier()
    yield
    if d.is_main:
        dist.barrier()


def quiet_deepspeed(debug: bool) -> None:
    """DeepSpeed logs every init at INFO and calls torch collectives torch now calls deprecated."""
    from deepspeed.utils import logger

    logger.setLevel(logging.INFO if debug else logging.WARNING)
    if not debug:
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


# -- optimizer and DeepSpeed config ------------------------------------------------------------

def param_groups(head: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms and biases are left alone (the usual AdamW split)."""
    decay = [p for p in head.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in head.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return groups


def deepspeed_config(cfg: DictConfig, world_size: int, device: torch.device,
                     head_dtype: torch.dtype) -> dict[str, Any]:
    t, z = cfg.train, cfg.deepspeed
    if z.zero_stage not in (0, 1, 2, 3):
        raise SpecHeadsError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {z.zero_stage}")
    zero: dict[str, Any] = {"stage": int(z.zero_stage)}
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if z.offload_param:
        if z.zero_stage != 3:
            raise SpecHeadsError("deepspeed.offload_param needs deepspeed.zero_stage=3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(t.batch_size),
        "gradient_accumulation_steps": int(t.grad_accum),
        "train_batch_size": int(t.batch_size) * int(t.grad_accum) * world_size,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": head_dtype == torch.bfloat16},
        "fp16": {"enabled": head_dtype == torch.float16},
        # our torch AdamW is fine under ZeRO; DeepSpeed only vouches for its own by default
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if z.offload_optimizer:
        # ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's own (compiled) CPU Adam.
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": float(t.lr), "betas": list(t.betas), "weight_decay": float(t.weight_decay)}}
    config.update(OmegaConf.to_container(z.extra, resolve=True) if isinstance(z.extra, DictConfig)
                  else dict(z.extra))
    return config


class HeadObjective(nn.Module):
    """What DeepSpeed wraps: the head, with its loss and its evaluation as forward modes.

    Going through the engine's forward (not head.loss directly) lets ZeRO-3 gather parameters.
    """

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, batch, states, evaluate: bool = False):
        return self.head.evaluate(batch, states) if evaluate else self.head.loss(batch, states)


def initialize(head: nn.Module, cfg: DictConfig, d: Dist, total_steps: int):
    """deepspeed.initialize on the head only. Returns the engine."""
    import deepspeed

    t = cfg.train
    head_dtype = next(head.parameters()).dtype
    config = deepspeed_config(cfg, d.world_size, d.device, head_dtype)
    groups = param_groups(head, float(t.weight_decay))
    optimizer = None
    if "optimizer" not in config:
        optimizer = torch.optim.AdamW(groups, lr=float(t.lr), betas=tuple(t.betas),
                                      weight_decay=float(t.weight_decay))

    def scheduler(opt):
        return warmup_cosine_scheduler(opt, int(t.warmup_steps), total_steps, float(t.min_lr_ratio))

    engine, *_ = deepspeed.initialize(model=HeadObjective(head), optimizer=optimizer,
                                      model_parameters=groups if optimizer is None else None,
                                      lr_scheduler=scheduler, config=config)
    return engine


# -- the training loop -------------------------------------------------------------------------

def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    values = values.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class Trainer:
    """Steps a DeepSpeed-wrapped head over a StateSource; checkpoints, evaluates, logs."""

    def __init__(self, cfg: DictConfig, head: nn.Module, source: StateSource, d: Dist,
                 output_dir: Path):
        self.cfg, self.head, self.source, self.d = cfg, head, source, d
        self.output_dir = output_dir
        t = cfg.train
        if t.batch_size < 1 or t.grad_accum < 1:
            raise SpecHeadsError("train.batch_size and train.grad_accum must be >= 1")
        source.require(*head.training_states())
        self.batches = TrainBatches(row_lengths(source.rows("train")), int(t.batch_size), d.rank,
                                    d.world_size, seed=int(cfg.seed), group_by_length=bool(t.group_by_length))
        eval_rows = source.rows("eval")
        self.eval_batches = eval_batches(row_lengths(eval_rows), int(t.batch_size), d.rank, d.world_size,
                                         max_batches=t.eval_batches) if len(eval_rows) else []
        self.max_steps = self.total_steps()
        self.engine = initialize(head, cfg, d, self.max_steps)
        self.checkpoints = Checkpoints(output_dir, int(t.keep_checkpoints), d.rank, d.world_size)
        self.step = 0
        self.last_eval: dict[str, float] = {}

    def total_steps(self) -> int:
        t = self.cfg.train
        if t.epochs is not None:
            micro = t.epochs * self.batches.batches_per_epoch
            return max(1, math.ceil(micro / t.grad_accum))
        if t.max_steps < 1:
            raise SpecHeadsError(f"train.max_steps must be >= 1, got {t.max_steps}")
        return int(t.max_steps)

    # -- resume ----------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What must match for a checkpoint to continue this run."""
        c = self.cfg
        return {"model": c.model.path, "head": OmegaConf.to_container(c.head, resolve=True),
                "batch_size": int(c.train.batch_size), "grad_accum": int(c.train.grad_accum),
                "world_size": self.d.world_size, "seed": int(c.seed),
                "train_rows": len(self.source.rows("train"))}

    def resume(self) -> int:
        self.checkpoints.remove_partial()
        latest = self.checkpoints.latest()
        if latest is None:
            return 0
        state = self.checkpoints.load(self.engine, latest)
        saved, now = state.get("fingerprint", {}), self.fingerprint()
        diffs = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if diffs:
            raise SpecHeadsError(f"{self.output_dir} holds a checkpoint of a different run ({'; '.join(diffs)}); "
                                 "use a new output_dir")
        self.step = int(state["step"])
        self.last_eval = state.get("last_eval", {})
        return self.step

    def save(self) -> None:
        self.checkpoints.save(self.engine, self.step, {
            "step": self.step, "micro_batches": self.step * int(self.cfg.train.grad_accum),
            "fingerprint": self.fingerprint(), "last_eval": self.last_eval})

    # -- steps -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step: grad_accum micro-batches of this rank's shard."""
        grad_accum = int(self.cfg.train.grad_accum)
        sums: dict[str, float] = {}
        tokens = 0
        for k in range(grad_accum):
            rows = self.batches[self.step * grad_accum + k]
            batch, states = self.source.fetch("train", rows)
            loss, metrics = self.engine(batch, states)
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
        packed = torch.cat([torch.tensor([loss_sum, loss_n, accept_sum, accept_n], dtype=torch.float64),
                            correct, total]).to(self.d.device)
        packed = _all_reduce_sum(packed).cpu()
        depth = correct.numel()
        out = {"eval/loss": float(packed[0] / packed[1].clamp(min=1)),
               "eval/sim_tau": 1.0 + float(packed[2] / packed[3].clamp(min=1))}
        for i in range(depth):
            out[f"eval/acc_{i}"] = float(packed[4 + i] / packed[4 + depth + i].clamp(min=1))
        return out

    def _reduce_train_metrics(self, window: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted(window[0])
        local = torch.tensor([sum(m.get(k, 0.0) for m in window) for k in keys], dtype=torch.float64)
        summed = _all_reduce_sum(local.to(self.d.device)).cpu()
        out = {}
        for k, v in zip(keys, summed.tolist()):
            out[f"train/{k}"] = v if k == "tokens" else v / (len(window) * self.d.world_size)
        return out

    def fit(self, log: MetricsLog) -> dict[str, float]:
        t = self.cfg.train
        start = self.step
        bar = tqdm(total=self.max_steps, initial=start, desc="train", disable=not self.d.is_main,
                   dynamic_ncols=True, file=sys.stderr)
        window: list[dict[str, float]] = []
        postfix: dict[str, str] = {}
        window_start = time.perf_counter()
        self.engine.train()
        while self.step < self.max_steps:
            window.append(self.train_step())
            bar.update(1)
            last = self.step == self.max_steps
            if self.step % max(1, int(t.log_every)) == 0 or last:
                metrics = self._reduce_train_metrics(window)
                elapsed = time.perf_counter() - window_start
                metrics["train/tokens_per_s"] = metrics.pop("train/tokens") / elapsed
                metrics["train/steps_per_s"] = len(window) / elapsed
                metrics["train/lr"] = float(self.engine.get_lr()[0])
                grad_norm = self.engine.get_global_grad_norm()
                if grad_norm is not None:
                    metrics["train/grad_norm"] = float(grad_norm)
                metrics["train/epoch"] = self.step * int(t.grad_accum) / self.batches.batches_per_epoch
                log.log(self.step, metrics)
                postfix.update(loss=f"{metrics['train/loss']:.3f}", lr=f"{metrics['train/lr']:.2e}")
                bar.set_postfix(postfix)
                window, window_start = [], time.perf_counter()
            if (t.eval_every > 0 and self.step % t.eval_every == 0) or last:
                self.last_eval = self.evaluate()
                if self.last_eval:
                    log.log(self.step, self.last_eval)
                    postfix["sim_tau"] = f"{self.last_eval['eval/sim_tau']:.2f}"
                    bar.set_postfix(postfix)
            if (t.save_every > 0 and self.step % t.save_every == 0) or last:
                self.save()
        bar.close()
        return self.last_eval


# -- the whole job -----------------------------------------------------------------------------

def open_state_source(cfg: DictConfig, target, d: Dist) -> StateSource:
    """Offline features when data.features names a cache (or is "auto": cached on first use
    under the cache root, keyed by target, layers, template and the rows), else online target
    states over build_datasets rows."""
    pad_id = target.tokenizer.pad_token_id
    features = cfg.data.get("features")
    if features == "auto":
        features = str(ensure_auto_features(cfg, target, d))
    if features:
        from ..data.features import OfflineStates

        return OfflineStates(features, target, int(cfg.data.max_length), pad_id=pad_id,
                             device=d.device, dtype=target.dtype)
    train_rows, eval_rows = _datasets(cfg, target, d)
    return OnlineStates(target, {"train": train_rows, "eval": eval_rows}, pad_id=pad_id)


def _datasets(cfg: DictConfig, target, d: Dist):
    from ..data.conversations import build_datasets

    with main_rank_first(d):
        return build_datasets(cfg.data, target.tokenizer, target=target)


def ensure_auto_features(cfg: DictConfig, target, d: Dist) -> Path:
    """data.features=auto: one target pass over the data caches the states this head trains on
    (bf16 on GPU, fp32 on CPU), so every further epoch costs only the head's own compute."""
    from ..data.features import auto_features_dir, ensure_split_features
    from ..heads.spec import HeadSpec

    train_rows, eval_rows = _datasets(cfg, target, d)
    layer_ids = HeadSpec.from_config(cfg.head, target.info).layer_ids
    dtype = "float32" if target.dtype == torch.float32 else "bfloat16"
    splits = {"train": train_rows, "eval": eval_rows}
    directory = auto_features_dir(target, splits, layer_ids, True, int(cfg.data.max_length), dtype)
    with main_rank_first(d):
        ensure_split_features(target, splits, layer_ids, True, directory, int(cfg.data.max_length),
                              dtype=dtype, data_fingerprint=directory.name)
    return directory


def export_head(head: nn.Module, engine, directory: Path, training: dict[str, Any], d: Dist) -> Path:
    """Rank 0 writes the head (gathering ZeRO-3 shards first); every rank returns the path."""
    from ..heads import save_head

    params = list(head.parameters())
    gathered = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with gathered:
        if d.is_main:
            save_head(head, directory, training=training)
    dist.barrier()
    return directory


def train(cfg: DictConfig) -> Optional[Path]:
    """Run (or resume) the training job described by cfg. Returns output_dir/head on rank 0."""
    from ..heads import build_head
    from ..target import load_target

    d = setup_distributed(cfg.device)
    quiet_deepspeed(bool(cfg.debug))
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(cfg.seed))  # the same head initialisation on every rank
    target = load_target(cfg.model, d.device)
    source = open_state_source(cfg, target, d)
    with main_rank_first(d):  # EAGLE-3 caches its draft vocab on first build
        head = build_head(cfg.head, target, train_rows=source.rows("train"))
    trainer = Trainer(cfg, head, source, d, output_dir)
    resumed = trainer.resume()
    if resumed == 0:
        torch.manual_seed(int(cfg.seed) + d.rank)  # a noise stream per rank (a resumed run restores its own)
    elif d.is_main:
        print(f"resuming from step {resumed} ({trainer.checkpoints.latest()})", file=sys.stderr)
    log = MetricsLog(output_dir, cfg.wandb, OmegaConf.to_container(cfg, resolve=True),
                     enabled=d.is_main, resume_step=resumed)
    try:
        last_eval = trainer.fit(log)
    finally:
        log.close()
    training = {"steps": trainer.step, "seed": int(cfg.seed), "world_size": d.world_size,
                "batch_size": int(cfg.train.batch_size), "grad_accum": int(cfg.train.grad_accum),
                "lr": float(cfg.train.lr), "data": cfg.data.path, "eval": last_eval}
    path = export_head(head, trainer.engine, output_dir / "head", training, d)
    if d.is_main:
        plot_metrics(output_dir / "metrics.jsonl", output_dir / "curves.png")
        if last_eval:
            accs = " ".join(f"{last_eval[k]:.3f}" for k in sorted(
                (k for k in last_eval if k.startswith("eval/acc_")), key=lambda k: int(k.rsplit("_", 1)[1])))
            print(f"step {trainer.step}: eval loss {last_eval['eval/loss']:.4f}, top-1 per depth [{accs}], "
                  f"sim tau {last_eval['eval/sim_tau']:.3f}")
    dist.destroy_process_group()
    return path if d.is_main else None
