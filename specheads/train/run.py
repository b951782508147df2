"""The train.py job: the frozen target on every rank (whole, or sharded over the ranks), the data,
the head and its state source, the Trainer, and the head directory written at the end.

One code path serves one process (CPU or GPU) and N processes started by `deepspeed train.py` or
`torchrun` (specheads.distributed).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..config.train import DataConfig, TrainJobConfig
from ..data.datasets import build_datasets
from ..data.features import auto_features_dir, ensure_split_features
from ..distill.builtin import ensure_builtin_data
from ..distributed import Dist, main_rank_first, process_group, quiet_deepspeed
from ..errors import SpecHeadsError
from ..heads import HEADS, DraftHead, build_head, warm_start
from ..heads.io import WEIGHTS_NAME, read_head_config
from ..heads.objectives import check_loss_fn
from ..provenance import data_record, file_digest, portable_path, provenance
from ..target import FLOAT_DTYPES, FrozenTarget, load_target
from .arch import read_arch
from .budget import check_epochs, check_real_target, dry_run
from .checkpoint import Checkpoints
from .metrics import MetricsLog, plot_metrics
from .on_policy import build_stage, check_settings
from .plan import check_fits, shard_decision
from .sharded_target import check_shardable, frozen_parts_gathered, load_sharded_target
from .state_source import OfflineStates, OnlineStates, StateSource
from .trainer import Trainer, autocast_dtype


def data_splits(data_cfg: DataConfig, target: FrozenTarget, d: Dist) -> dict:
    """{"train": rows, "eval": rows} of the configured data; data.path=builtin is written by the
    target itself first (rank 0 builds and caches, the others reuse its cache)."""
    with main_rank_first(d):
        if data_cfg.path == "builtin":
            data_cfg = replace(data_cfg, path=str(ensure_builtin_data(target, data_cfg)))
        train_rows, eval_rows = build_datasets(data_cfg, target.tokenizer)
    return {"train": train_rows, "eval": eval_rows}


def head_and_states(cfg: TrainJobConfig, target: FrozenTarget, d: Dist) -> tuple[DraftHead, StateSource]:
    """A fresh head and the source of its target states: the feature cache data.features names,
    else target forwards over the data, which data.features=auto caches on first use (under the
    cache root, keyed by target, the head's training states, template and rows)."""
    pad_id = target.tokenizer.pad_token_id
    features = cfg.data.features
    if features and features != "auto":
        source: StateSource = OfflineStates(
            features, target, cfg.data.max_length, pad_id=pad_id, device=d.device, dtype=target.dtype
        )
    else:
        splits = data_splits(cfg.data, target, d)
        source = OnlineStates(target, splits, pad_id=pad_id, autocast=autocast_dtype(cfg.train.autocast, target.dtype))
    with main_rank_first(d):  # EAGLE-3 caches its draft vocab on first build
        head = build_head(cfg.head, target, train_rows=source.rows("train"))
    if features == "auto":
        directory = ensure_auto_features(target, splits, *head.training_states(), cfg.data.max_length)
        source = OfflineStates(
            directory, target, cfg.data.max_length, pad_id=pad_id, device=d.device, dtype=target.dtype
        )
    return head, source


def check_state_source(cfg: TrainJobConfig) -> None:
    """A head that adapts the target (Medusa-2) trains on the adapted target's own forwards: no
    feature cache of the original's states can feed it."""
    family = HEADS.get(cfg.head.family)
    if cfg.data.features and family is not None and family.adapts_target:
        raise SpecHeadsError(
            f"head={cfg.head.family} trains a LoRA on the target, so its states come from the adapted target's "
            f"own forwards: data.features={cfg.data.features} cannot feed it; drop data.features"
        )


def ensure_auto_features(
    target: FrozenTarget, splits: dict, layer_ids: list[int], final: bool, max_length: int
) -> Path:
    """data.features=auto: one target pass over the data caches the states the head trains on
    (bf16 on GPU, fp32 on CPU), so every further epoch costs only the head's own compute. The
    ranks share that pass: each writes its shards of the cache."""
    dtype = "float32" if target.dtype == torch.float32 else "bfloat16"
    directory = auto_features_dir(target, splits, layer_ids, final, max_length, dtype)
    ensure_split_features(
        target, splits, layer_ids, final, directory, max_length, dtype=dtype, data_fingerprint=directory.name
    )
    return directory


def warm_started(cfg: TrainJobConfig, head: DraftHead, target: FrozenTarget) -> dict:
    """train.init_from: the fresh head takes that head's weights; the record the new head keeps of
    it (its path, weights digest and its own training record, so a continued head names every run
    behind it). {} without init_from."""
    if not cfg.train.init_from:
        return {}
    directory = Path(cfg.train.init_from)
    return init_from_record(directory, warm_start(head, directory, target).training_record)


def init_from_record(directory: Path, training: dict | None) -> dict:
    return {
        "init_from": {
            "head": portable_path(directory),
            "weights_sha256": file_digest(directory / WEIGHTS_NAME),
            "training": training or {},
        }
    }


def init_from_reread(cfg: TrainJobConfig) -> dict:
    """The init_from record of a run resumed from a checkpoint written before checkpoints kept it:
    read again from the head directory if it is still there, else its path alone."""
    if not cfg.train.init_from:
        return {}
    directory = Path(cfg.train.init_from)
    if not (directory / WEIGHTS_NAME).is_file():
        return {"init_from": {"head": portable_path(directory), "weights_sha256": None, "training": None}}
    return init_from_record(directory, read_head_config(directory).get("training"))


def training_record(
    cfg: TrainJobConfig,
    d: Dist,
    step: int,
    last_eval: dict,
    origin: dict,
    segments: list[dict],
    best: dict | None = None,
) -> dict:
    """What a head directory records of the run that wrote it (at its end, or at a checkpoint).
    origin: what the run read at its start (data digests, code version, commit, command), not at the
    write: a commit made while a run trains is not the code that trained it. segments (Trainer.segments):
    recorded when more than one process trained the run (it was resumed), since the commit and
    command above are then only the last one's. best (Trainer.best): the evaluation OUTPUT_DIR/best
    was kept for so far, its criterion and step."""
    resumed = {"segments": segments} if len(segments) > 1 else {}
    return {
        "steps": step,
        "seed": cfg.seed,
        **({"data_seed": cfg.data_seed} if cfg.data_seed is not None else {}),
        "world_size": d.world_size,
        "batch_size": cfg.train.batch_size,
        "grad_accum": cfg.train.grad_accum,
        "lr": cfg.train.lr,
        # the data as a path inside its repository or a name, with the digests of local sources
        "data": portable_path(cfg.data.path),
        "data_mix": [portable_path(m) for m in cfg.data.mix],
        **origin,
        **resumed,
        "eval": last_eval,
        **({"best": best} if best else {}),
    }


def check_budget(cfg: TrainJobConfig, trainer: Trainer) -> None:
    """A real target's run that trains on a sliver of its data is refused (specheads.train.budget)."""
    try:
        parameters = read_arch(cfg.model).num_parameters
    except SpecHeadsError:
        return
    epochs = trainer.total_steps() * cfg.train.grad_accum / max(1, trainer.batches.batches_per_epoch)
    check_epochs(cfg, parameters, epochs, len(trainer.source.rows("train")))


def check_train_settings(t) -> None:
    """The train.* values no run can start with, refused in one line before anything is loaded."""
    limits = [
        (t.epochs is not None or t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}"),
        (t.epochs is None or t.epochs > 0, f"train.epochs must be > 0 (or null), got {t.epochs}"),
        (t.max_minutes is None or t.max_minutes > 0, f"train.max_minutes must be > 0 (or null), got {t.max_minutes}"),
        (t.batch_size >= 1 and t.grad_accum >= 1, "train.batch_size and train.grad_accum must be >= 1"),
        (t.lr >= 0, f"train.lr must be >= 0 (0 trains nothing: a head rewritten as it is), got {t.lr}"),
        (t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}"),
        (0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"),
    ]
    for ok, message in limits:
        if not ok:
            raise SpecHeadsError(message)


def train(cfg: TrainJobConfig) -> Path | None:
    """Run (or resume) the training job described by cfg. Returns output_dir/head on rank 0;
    with dry_run, prints the memory plan instead and returns None, having loaded nothing."""
    check_train_settings(cfg.train)
    check_settings(cfg)  # train.on_policy
    check_loss_fn(cfg.head.loss_fn, cfg.head.lk_eta)  # before anything loads (HeadSpec checks it again)
    if cfg.dry_run:
        text = dry_run(cfg)
        if text:
            print(text, flush=True)
        return None
    check_state_source(cfg)
    check_real_target(cfg)
    if cfg.save_dtype != "auto" and cfg.save_dtype not in FLOAT_DTYPES:
        raise SpecHeadsError(f"save_dtype must be auto or one of {', '.join(FLOAT_DTYPES)}, got {cfg.save_dtype!r}")
    with process_group(cfg.device) as d:
        path = train_in_group(cfg, d)
    return path if d.is_main else None


def train_in_group(cfg: TrainJobConfig, d: Dist) -> Path:
    """The job on this rank of the process group `d`; the head directory it wrote."""
    code = provenance()  # the code this process runs, whatever the work tree holds when heads are written
    quiet_deepspeed(cfg.debug)
    # before the target is loaded: a run whose target (whole, or its shard) cannot fit a rank is refused here
    on_gpu = d.device.type == "cuda"
    shard = shard_decision(cfg, d.world_size, on_gpu)
    if shard:
        check_shardable(cfg)
        if cfg.train.on_policy.enabled:
            raise SpecHeadsError(
                "train.on_policy rolls out with the whole target on every rank, but this run shards it "
                "(deepspeed.shard_target): set deepspeed.shard_target=false or drop train.on_policy"
            )
    warning = check_fits(cfg, d.world_size, on_gpu, sharded=shard)
    if warning and d.is_main:
        print(warning, file=sys.stderr)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)  # the same head initialisation on every rank
    target = load_sharded_target(cfg.model, d) if shard else load_target(cfg.model, d.device)
    if shard and d.is_main:
        print(f"train: the frozen target is sharded over {d.world_size} ranks (ZeRO-3 inference)", file=sys.stderr)
    # a resume takes every weight from its checkpoint, and the init_from record from there too: the
    # head it started from is not read again (it may have been rewritten or deleted since)
    resuming = Checkpoints(output_dir).latest() is not None
    with frozen_parts_gathered(target):  # a head copies from the target's embedding / LM head when built
        head, source = head_and_states(cfg, target, d)
        init = {} if resuming else warm_started(cfg, head, target)
    trainer = Trainer(cfg, head, source, d, output_dir)
    autocast = autocast_dtype(cfg.train.autocast, target.dtype)
    trainer.on_policy = build_stage(cfg, head, target, source.rows("train"), d, autocast)  # None when off
    check_budget(cfg, trainer)
    trainer.init_record = init
    resumed = trainer.resume()
    if trainer.init_record is None:
        trainer.init_record = init_from_reread(cfg)
    if resumed == 0:
        torch.manual_seed(cfg.seed + d.rank)  # a noise stream per rank (a resumed run restores its own)
    elif d.is_main:
        print(f"resuming from step {resumed} ({trainer.checkpoints.latest()})", file=sys.stderr)
    log = MetricsLog(
        output_dir, cfg.wandb, asdict(cfg), enabled=d.is_main, resume_step=resumed, tracker_cfg=cfg.tracker
    )
    origin = {
        "data_sha256": data_record([cfg.data.path, *cfg.data.mix]),
        "chat": target.chat_record(),  # the chat template and model.thinking the head trained on
        **code,
        **trainer.init_record,
    }
    record = getattr(source, "record", None)  # where the target's states came from (a cache: who wrote it)
    if record is not None:
        origin["features"] = record()
    trainer.origin = code
    trainer.head_record = lambda t: training_record(cfg, d, t.step, t.last_eval, origin, t.segments(), t.best)
    try:
        last_eval = trainer.fit(log)
    finally:
        log.close()
    path = trainer.write_head(output_dir / "head", trainer.head_record(trainer))  # the record every kept head gets
    if d.is_main:
        if trainer.best:
            best = trainer.best
            print(
                f"train: best head: step {best['step']}, {best['metric']} {best['value']:.3f} "
                f"({output_dir / 'best'}; the last is {path})",
                file=sys.stderr,
            )
        plot_metrics(output_dir / "metrics.jsonl", output_dir / "curves.png")
        if last_eval:
            accs = " ".join(
                f"{last_eval[k]:.3f}"
                for k in sorted(
                    (k for k in last_eval if k.startswith("eval/acc_")), key=lambda k: int(k.rsplit("_", 1)[1])
                )
            )
            print(
                f"step {trainer.step}: eval loss {last_eval['eval/loss']:.4f}, top-1 per depth [{accs}], "
                f"sim tau {last_eval['eval/sim_tau']:.3f}"
            )
    return path
