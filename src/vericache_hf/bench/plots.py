"""The bench's three figures, drawn with matplotlib's Agg backend into PNG files.

1. throughput against compression ratio: full cache, compressed-only and VeriCache;
2. quality (identical-to-full share, parse rate) against throughput: the trade-off lossy methods force;
3. accepted tokens per round over the course of a generation.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

COLORS = {
    "full": "black",
    "lossy": "tab:red",
    "vericache": "tab:blue",
    "prompt_lookup": "tab:green",
    "early_exit": "tab:purple",
}
SCHEDULE_STYLES = {"adaptive": "-.^", "fixed": ":v"}  # VeriCache curves, when schedules are compared


def _ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def _mean_by(rows: list[dict], key: str) -> dict[str, float]:
    """Mean of `key` per method over the workloads where it was measured."""
    values: dict[str, list[float]] = {}
    for row in rows:
        if _ok(row.get(key)):
            values.setdefault(row["method"], []).append(row[key])
    return {name: mean(v) for name, v in values.items()}


def plot_throughput(rows: list[dict], path: Path, key: str = "decode_ratio") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ratios = _mean_by(rows, key)
    ax.axhline(1.0, color=COLORS["full"], linestyle="--", label="full cache")
    curves: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for row in rows:
        if row["family"] in ("lossy", "vericache") and row["method"] in ratios:
            point = (row["compression_ratio"], ratios[row["method"]])
            curve = curves.setdefault((row["family"], row["compressor"], row.get("draft_schedule") or ""), [])
            if point not in curve:
                curve.append(point)
    for (family, compressor, schedule), points in sorted(curves.items()):
        points.sort()
        label = f"{compressor} only (lossy)" if family == "lossy" else f"VeriCache ({compressor})"
        label += f" [{schedule}]" if schedule else ""
        style = "--o" if family == "lossy" else SCHEDULE_STYLES.get(schedule, "-s")
        ax.plot(*zip(*points, strict=True), style, color=COLORS[family], label=label, alpha=0.85)
    return _finish(
        fig,
        ax,
        path,
        xlabel="compression ratio (fraction of the KV cache removed)",
        ylabel="decode tokens/s relative to full cache",
        title="Throughput against compression ratio",
        legend_size=8,
    )


def plot_quality(rows: list[dict], path: Path, key: str = "decode_ratio") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    speed = _mean_by(rows, key)
    identical = _mean_by(rows, "identical_share")
    parsed = _mean_by(rows, "parse_share")
    palette = plt.get_cmap("tab10")
    for index, (name, x) in enumerate(speed.items()):
        color = palette(index % 10)
        if name in identical:
            ax.scatter(x, identical[name], color=color, marker="o", s=50, label=name, alpha=0.8)
        if name in parsed:
            ax.scatter(x, parsed[name], color=color, marker="^", s=40, alpha=0.6)
    ax.scatter([], [], color="gray", marker="o", label="(circle) identical to full-cache output")
    ax.scatter([], [], color="gray", marker="^", label="(triangle) code parses (ast.parse)")
    ax.set_ylim(-0.05, 1.1)
    return _finish(
        fig,
        ax,
        path,
        xlabel="decode tokens/s relative to full cache",
        ylabel="share of outputs",
        title="Quality against throughput",
        loc="center right",
    )


def plot_acceptance(rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        series = row.get("accepted_per_round")
        if row["family"] == "vericache" and series:
            ax.plot(
                range(1, len(series) + 1), series, marker=".", label=f"{row['method']}, {row['workload']}"
            )
            lengths = row.get("draft_lengths") or []
            if lengths:
                ax.plot(range(1, len(lengths) + 1), lengths, linestyle=":", color="gray", alpha=0.5)
    ax.plot([], [], linestyle=":", color="gray", label="draft length")
    return _finish(
        fig,
        ax,
        path,
        xlabel="round",
        ylabel="accepted draft tokens (mean over rows)",
        title="Accepted tokens per round over a generation (first batch)",
    )


def _finish(
    fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str, legend_size: int = 7, **legend
) -> Path:
    """The labels, title, legend and grid every figure has; then save it to `path` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size, **legend)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(rows: list[dict], out_dir: Path) -> list[Path]:
    return [
        plot_throughput(rows, out_dir / "throughput_vs_ratio.png"),
        plot_quality(rows, out_dir / "quality_vs_throughput.png"),
        plot_acceptance(rows, out_dir / "acceptance_per_round.png"),
    ]
