"""Experiment trackers (`tracker=...`): Weights & Biases, TensorBoard and MLflow, each through its
own library, all given the same metrics and the run config, offline by default (files under the
output_dir). A resumed output_dir continues each tracker's run: W&B and MLflow by a run id kept in
the output_dir, TensorBoard by the same event directory with what followed the checkpoint purged."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from ..errors import SpecHeadsError

TRACKERS = ("wandb", "tensorboard", "mlflow")
WANDB_MODES = ("disabled", "offline", "online")
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer parameter values


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: list[str], wandb_cfg: Any) -> None:
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise SpecHeadsError(f"unknown tracker {unknown[0]!r}: choose from {', '.join(TRACKERS)} (or none)")
    if wandb_cfg.mode not in WANDB_MODES:
        raise SpecHeadsError(f"wandb.mode must be one of {', '.join(WANDB_MODES)}, got {wandb_cfg.mode!r}")


def start_trackers(
    names: list[str], output_dir: Path, tracker_cfg: Any, wandb_cfg: Any, run_config: dict, resume_step: int
) -> list[Tracker]:
    """The trackers `names` picks, started (wandb.mode=disabled leaves W&B out)."""
    check_trackers(names, wandb_cfg)
    started: list[Tracker] = []
    for name in names:
        if name == "wandb" and wandb_cfg.mode != "disabled":
            started.append(WandbTracker(output_dir, wandb_cfg, run_config))
        elif name == "tensorboard":
            started.append(TensorBoardTracker(output_dir, run_config, resume_step))
        elif name == "mlflow":
            started.append(MlflowTracker(output_dir, tracker_cfg, run_config))
    return started


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics as plain floats (tensors, numpy scalars); anything else is not a metric."""
    out = {}
    for key, value in metrics.items():
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def flat_config(node: Any, prefix: str = "") -> dict[str, str]:
    """{"train.lr": "0.002", ...}: the run config as MLflow parameters (strings, dotted keys)."""
    if isinstance(node, dict) and node:
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(flat_config(value, f"{prefix}{key}."))
        return out
    text = node if isinstance(node, str) else json.dumps(node)
    return {prefix.rstrip("."): text[:MLFLOW_PARAM_CHARS]}


def kept_run_id(path: Path) -> str | None:
    return (path.read_text().strip() or None) if path.is_file() else None


class WandbTracker:
    def __init__(self, output_dir: Path, wandb_cfg: Any, run_config: dict):
        import wandb

        # One run id per output_dir, so a resumed training continues the same wandb run.
        id_file = output_dir / "wandb-run-id"
        run_id = kept_run_id(id_file) or uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        try:
            self.run = wandb.init(
                mode=wandb_cfg.mode,
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                dir=str(output_dir),
                config=run_config,
                id=run_id,
                resume="allow",
                settings=wandb.Settings(silent=True),
            )
        except Exception as err:  # wandb raises its own error types for login / network problems
            raise SpecHeadsError(
                f"wandb.init failed ({wandb_cfg.mode}): {str(err).splitlines()[0]}; "
                "use wandb.mode=offline or wandb.mode=disabled"
            ) from err

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, output_dir: Path, run_config: dict, resume_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise SpecHeadsError(
                "tracker=tensorboard needs the tensorboard package: pip install 'specheads[trackers]'"
            ) from err
        # purge_step: TensorBoard's readers drop what the interrupted run logged after the checkpoint
        self.writer = SummaryWriter(
            str(output_dir / TENSORBOARD_DIR), purge_step=resume_step + 1 if resume_step else None, flush_secs=10
        )
        # indented: TensorBoard renders text as Markdown, and this keeps the JSON a code block
        text = "\n".join("    " + line for line in json.dumps(run_config, indent=2, default=str).splitlines())
        self.writer.add_text("run_config", text, global_step=resume_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    def __init__(self, output_dir: Path, tracker_cfg: Any, run_config: dict):
        try:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise SpecHeadsError(
                "tracker=mlflow needs MLflow (mlflow or mlflow-skinny): pip install 'specheads[trackers]'"
            ) from err
        uri = tracker_cfg.mlflow_uri
        if uri is None:
            uri = (output_dir / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 keeps its file store in maintenance mode behind this opt-in; a local store
            # needs no server or database, and a user's own setting of the variable still wins
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.id_file = output_dir / "mlflow-run-id"
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = self._continue_or_create(tracker_cfg)
            known = self.client.get_run(self.run_id).data.params
            # parameters cannot change once logged: a resumed run adds only keys it did not have
            params = {k: v for k, v in flat_config(run_config).items() if k not in known}
            self._batch(params=params)
            self.client.log_dict(self.run_id, run_config, "run_config.json")  # the latest run's, in full
        except MlflowException as err:
            raise SpecHeadsError(f"MLflow at {uri}: {str(err).splitlines()[0]}") from err

    def _continue_or_create(self, tracker_cfg: Any) -> str:
        from mlflow.exceptions import MlflowException

        run_id = kept_run_id(self.id_file)
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                return run_id
            except MlflowException:
                pass  # not in this store (another tracker.mlflow_uri): a new run
        experiment = self.client.get_experiment_by_name(tracker_cfg.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(tracker_cfg.mlflow_experiment)
        )
        run_id = self.client.create_run(experiment_id, run_name=tracker_cfg.mlflow_run_name).info.run_id
        self.id_file.write_text(run_id)
        return run_id

    def _batch(self, metrics: dict[str, float] | None = None, step: int = 0, params: dict | None = None) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(k, v, now, step) for k, v in (metrics or {}).items()],
            params=[Param(k, v) for k, v in (params or {}).items()],
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._batch(numbers(metrics), step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
