"""tracker=...: each tracker writes what its own reader reads back (TensorBoard's EventAccumulator,
MLflow's client on the local store), a resumed run continues the same run, and the choice of
trackers is the same from the command line and the Python API."""

import json
from pathlib import Path

import pytest
from conftest import write_conversations
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specheads.cli import config_error_line
from specheads.config import register_configs, typed
from specheads.config.model import ModelConfig
from specheads.config.train import DataConfig, HeadConfig, TrackerConfig, TrainConfig, TrainJobConfig, WandbConfig
from specheads.errors import SpecHeadsError
from specheads.train import run
from specheads.train.metrics import MetricsLog, read_metrics
from specheads.train.trackers import check_trackers

pytestmark = pytest.mark.usefixtures("one_thread")

CONF = Path(__file__).resolve().parents[2] / "conf"
RUN_CONFIG = {"train": {"lr": 0.002, "betas": [0.9, 0.95]}, "seed": 0, "wandb": {"entity": None}}


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = (out / "mlflow-run-id").read_text().strip()
    return client, client.get_run(run_id)


def logged(out: Path, tracker: TrackerConfig, resume_step: int, steps: range, scale: float) -> None:
    log = MetricsLog(out, WandbConfig(), RUN_CONFIG, enabled=True, resume_step=resume_step, tracker_cfg=tracker)
    for step in steps:
        log.log(step, {"train/loss": scale * step, "eval/sim_tau": 1.0 + step / 10})
    log.close()


def test_tensorboard_events_read_back_and_a_resume_purges_what_followed_the_checkpoint(tmp_path):
    tracker = TrackerConfig(tensorboard=True)
    logged(tmp_path, tracker, 0, range(1, 5), 1.0)
    logged(tmp_path, tracker, 2, range(3, 5), 10.0)  # killed after step 4, resumed from step 2
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [s for s, _ in scalars["eval/sim_tau"]] == [1, 2, 3, 4]
    assert not (tmp_path / "wandb").exists()  # another tracker chosen: W&B is off


def test_mlflow_local_store_reads_back_and_a_resume_continues_the_same_run(tmp_path):
    tracker = TrackerConfig(mlflow=True)
    logged(tmp_path, tracker, 0, range(1, 3), 1.0)
    client, first = mlflow_run(tmp_path)
    assert first.info.status == "FINISHED"
    assert first.data.params["train.lr"] == "0.002" and first.data.params["train.betas"] == "[0.9, 0.95]"
    logged(tmp_path, tracker, 2, range(3, 5), 1.0)
    client, again = mlflow_run(tmp_path)
    assert again.info.run_id == first.info.run_id and len(client.search_runs([again.info.experiment_id])) == 1
    history = client.get_metric_history(again.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    config = json.loads(
        Path(client.download_artifacts(again.info.run_id, "run_config.json", str(tmp_path))).read_text()
    )
    assert config == RUN_CONFIG


def test_every_tracker_gets_the_same_metrics_in_a_training_run(tmp_path):
    """train(cfg) with tracker=[tensorboard,mlflow]: both hold what metrics.jsonl holds."""
    data = write_conversations(tmp_path / "chats.jsonl", n=16)
    out = tmp_path / "run"
    cfg = TrainJobConfig(
        model=ModelConfig(name="tiny-random", path="tiny:llama"),
        head=HeadConfig(family="medusa"),
        data=DataConfig(path=str(data), max_length=64, eval_fraction=0.25),
        train=TrainConfig(warmup_steps=1, batch_size=2, max_steps=2, log_every=1, eval_every=1),
        tracker=TrackerConfig(tensorboard=True, mlflow=True),
        output_dir=str(out),
    )
    run.train(cfg)
    records = read_metrics(out / "metrics.jsonl")
    want = {}
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, float):
                want.setdefault(key, []).append((r["step"], value))
    assert {"train/loss", "eval/sim_tau", "train/tokens_per_s"} <= set(want)
    scalars = tensorboard_scalars(out / "tensorboard")
    client, mlflow = mlflow_run(out)
    for key, series in want.items():
        steps, values = [s for s, _ in series], [v for _, v in series]
        history = [(m.step, m.value) for m in client.get_metric_history(mlflow.info.run_id, key)]
        assert [s for s, _ in history] == steps and [v for _, v in history] == values, key
        # TensorBoard keeps float32
        assert [s for s, _ in scalars[key]] == steps, key
        assert [v for _, v in scalars[key]] == pytest.approx(values, rel=1e-6), key
    assert mlflow.data.params["head.family"] == "medusa"
    assert not (out / "wandb").exists()


@pytest.fixture
def hydra_conf():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    "override,chosen",
    [
        ([], ["wandb"]),
        (["tracker=tensorboard"], ["tensorboard"]),
        (["tracker=[wandb,tensorboard]"], ["wandb", "tensorboard"]),
        (["tracker=[mlflow,tensorboard]"], ["tensorboard", "mlflow"]),
        (["tracker=none"], []),
    ],
)
def test_tracker_group_chooses_one_or_several(hydra_conf, override, chosen):
    assert typed(compose("config", ["model=tiny-random", *override])).tracker.chosen() == chosen


def test_python_api_defaults_to_wandb_like_the_command_line():
    assert TrackerConfig().chosen() == ["wandb"]
    assert TrackerConfig(mlflow=True).chosen() == ["mlflow"]  # as tracker=mlflow


def test_an_unknown_tracker_fails_in_one_line(hydra_conf):
    with pytest.raises(Exception) as info:
        compose("config", ["tracker=comet"])
    line = config_error_line(info.value)
    assert "tracker/comet" in line and "available: mlflow, none, tensorboard, wandb" in line
    with pytest.raises(SpecHeadsError, match=r"^unknown tracker 'comet': choose from wandb, tensorboard, mlflow"):
        check_trackers(["tensorboard", "comet"], WandbConfig())


def test_wandb_mode_disabled_still_disables_wandb(tmp_path):
    log = MetricsLog(tmp_path, WandbConfig(mode="disabled"), {}, enabled=True, tracker_cfg=TrackerConfig(wandb=True))
    assert log.trackers == []
    log.close()
    with pytest.raises(SpecHeadsError, match="wandb.mode must be one of"):
        MetricsLog(tmp_path, WandbConfig(mode="off"), {}, enabled=False)
