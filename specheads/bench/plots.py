"""Benchmark figures (matplotlib, Agg backend: no display needed). Writes are atomic."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from ..atomic import save_figure  # noqa: E402


def _save(fig, path: Path) -> None:
    save_figure(fig, path, dpi=120, bbox_inches="tight")


def plot_tau_per_category(summary: dict, path: Path) -> None:
    """Grouped bars: tau of each method in each category (and overall)."""
    methods = list(summary)
    categories = [c for c in summary[methods[0]]] if methods else []
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories) + 2), 3.6))
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [summary[m].get(c, {}).get("tau", 0.0) for c in categories], width, label=m)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(categories))])
    ax.set_xticklabels(categories, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("Acceptance length per category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)


def plot_acceptance_per_depth(rates: Sequence[float], path: Path) -> None:
    """Conditional acceptance of the draft token at each depth of the tree."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    depths = list(range(1, len(rates) + 1))
    ax.bar(depths, rates, color="tab:green")
    for d, r in zip(depths, rates):
        ax.text(d, r + 0.01, f"{r:.2f}", ha="center", fontsize=8)
    ax.set_xticks(depths)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_title("Acceptance per depth")
    _save(fig, path)


def plot_replay(heads: dict, path: Path, depths: int = 5) -> None:
    """bench.mode=replay: tau of each head as a chain of K drafts, and with its best tree of n nodes
    (its own stored tree marked), and its acceptance at each chain depth given the one before."""
    fig, (left, right, third) = plt.subplots(1, 3, figsize=(14, 3.6))
    right.sharey(left)
    for label, r in heads.items():
        ks = [int(k) for k in r["chain_tau"]]
        line = left.plot(ks, list(r["chain_tau"].values()), marker="o", label=label)[0]
        ns = [int(n) for n in r["best_tree_tau"]]
        right.plot(ns, list(r["best_tree_tau"].values()), marker="o", color=line.get_color(), label=label)
        if r.get("tree"):
            right.plot([r["tree"]["nodes"]], [r["tree"]["tau"]], marker="*", markersize=14, color=line.get_color())
        rates = r.get("acceptance_per_depth", [])[:depths]
        third.plot(range(1, len(rates) + 1), rates, marker="o", color=line.get_color(), label=label)
    left.set_xlabel("chain length K (drafts per step)")
    left.set_ylabel("tau (tokens per target forward)")
    left.set_title("Chain of K")
    right.set_xlabel("tree nodes (star: the head's own tree)")
    right.set_title("Most frequent paths on these answers")
    third.set_xlabel("chain depth")
    third.set_ylabel("P(accepted | depth reached)")
    third.set_ylim(0, 1)
    third.set_title("Acceptance per depth")
    third.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)


def plot_replay_training(curves: dict[str, list[tuple[int, float, float]]], path: Path) -> None:
    """bench.mode=replay over the checkpoints of training runs: the benchmark's tau against the rows
    each head had read (one line per run), as a chain of 3 and with the best 5-node tree."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for label, points in curves.items():
        rows = [p[0] for p in points]
        line = left.plot(rows, [p[1] for p in points], marker="o", label=label)[0]
        right.plot(rows, [p[2] for p in points], marker="o", color=line.get_color(), label=label)
    for ax in (left, right):
        ax.set_xlabel("training rows read (steps x batch)")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 16k, not 16000 run into its neighbour
    left.set_ylabel("tau (tokens per target forward)")
    left.set_title("Chain of 3")
    right.set_title("Best 5-node tree")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    _save(fig, path)
