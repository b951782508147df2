"""Training metrics: metrics.jsonl (always, rank 0), the trackers `tracker=...` chose (W&B by
default, TensorBoard, MLflow: specheads.train.trackers), and a PNG of the loss and per-depth
accuracy curves written at the end of a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..atomic import save_figure, write_jsonl
from ..config.train import TrackerConfig
from .trackers import check_trackers, start_trackers


class MetricsLog:
    """Rank 0 appends one JSON object per log call and hands the same metrics to every tracker;
    the other ranks are silent."""

    def __init__(
        self,
        output_dir: Path,
        wandb_cfg: Any,
        run_config: dict,
        enabled: bool,
        resume_step: int = 0,
        tracker_cfg: TrackerConfig | None = None,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        tracker_cfg = tracker_cfg or TrackerConfig()
        names = tracker_cfg.chosen()
        check_trackers(names, wandb_cfg)  # on every rank: a bad setting fails the whole run alike
        self.trackers = []
        if not enabled:
            return
        # A resumed run drops what the interrupted one logged after its last checkpoint.
        records = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        write_jsonl(self.path, records)
        self.trackers = start_trackers(names, Path(output_dir), tracker_cfg, wandb_cfg, run_config, resume_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(int(step), metrics)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
    return records


def tokens_seen(records: list[dict]) -> dict[int, float]:
    """Training tokens read up to each logged step, summed over the logged windows.

    Each train record covers the steps since the one before it, and its tokens/s over steps/s is
    that window's tokens a step, so the sum needs nothing the log does not already hold (and
    stays right across a resume, which keeps the records up to its checkpoint)."""
    seen, total, last = {}, 0.0, 0
    for r in records:
        rate, steps_rate = r.get("train/tokens_per_s"), r.get("train/steps_per_s")
        if isinstance(rate, (int, float)) and isinstance(steps_rate, (int, float)) and steps_rate > 0:
            total += rate / steps_rate * (r["step"] - last)
            last = r["step"]
            seen[r["step"]] = total
    return seen


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Loss (train and eval) and eval top-1 accuracy per draft depth against the step, and the
    held-out simulated acceptance length against the training tokens read."""
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax_loss, ax_acc, ax_tau) = plt.subplots(1, 3, figsize=(16, 4))
    for key, style in (("train/loss", "-"), ("eval/loss", "o-")):
        xs, ys = series(key)
        if xs:
            ax_loss.plot(xs, ys, style, label=key, markersize=3)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    if ax_loss.lines:
        ax_loss.legend()

    # eval accuracy per draft depth (points), and the head's own training accuracy per depth
    # (dashed, same colour), which shows the trend between the few evaluations
    def depth(key):
        return int(key.rsplit("_", 1)[1])

    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/acc_")}, key=depth)
    train_keys = sorted({k for r in records for k in r if k.startswith("train/acc_")}, key=depth)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key in sorted(set(map(depth, eval_keys)) | set(map(depth, train_keys))):
        color = colors[key % len(colors)]
        xs, ys = series(f"eval/acc_{key}")
        if xs:
            ax_acc.plot(xs, ys, "o-", color=color, label=f"depth {key}", markersize=4)
        xs, ys = series(f"train/acc_{key}")
        if xs:
            ax_acc.plot(xs, ys, "--", color=color, alpha=0.6, label=None if eval_keys else f"depth {key}")
    xs, ys = series("eval/sim_tau")
    ax_acc.set_title(f"top-1 per depth (eval sim tau {ys[-1]:.2f} at step {xs[-1]})" if xs else "top-1 per depth")
    last_step = max(r["step"] for r in records)
    for ax in (ax_loss, ax_acc):
        ax.set_xlim(0, max(1, last_step) * 1.03)
    accs = [v for k in eval_keys + train_keys for v in series(k)[1]]
    ax_acc.set(
        xlabel="step",
        ylabel="top-1 accuracy (dots: eval, dashed: train)",
        ylim=(0, min(1.0, 1.2 * max(accs, default=1.0) + 0.02)),
    )
    if eval_keys or train_keys:
        ax_acc.legend(fontsize=7, ncol=2)

    # acceptance against data read: still rising at the end means more data or steps would pay
    seen = tokens_seen(records)
    taus = [(seen[r["step"]] / 1e6, r["eval/sim_tau"]) for r in records if "eval/sim_tau" in r and r["step"] in seen]
    if taus:
        ax_tau.plot([t[0] for t in taus], [t[1] for t in taus], "o-", markersize=4)
    ax_tau.set(xlabel="training tokens read (millions)", ylabel="eval sim tau", title="acceptance against data read")
    fig.tight_layout()
    return save_figure(fig, png_path, dpi=100)
