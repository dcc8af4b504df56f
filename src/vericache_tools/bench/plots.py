"""The bench's three figures, drawn with matplotlib's Agg backend into PNG files.

1. throughput against compression ratio: full cache, compressed-only and VeriCache;
2. quality (identical-to-full share, parse rate) against throughput: the trade-off lossy methods force;
3. accepted tokens per round over the course of a generation.

A run over several workloads gets a panel per workload in figures 1 and 3.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .report import workload_order  # noqa: E402

COLORS = {
    "full": "black",
    "lossy": "tab:red",
    "vericache": "tab:blue",
    "vericache+prompt_lookup": "tab:purple",  # the composed method
    "prompt_lookup": "tab:olive",  # peers: hues that the compressor pairs reach last
    "early_exit": "tab:cyan",
}
SCHEDULE_STYLES = {"adaptive": "-.", "fixed": ":"}  # VeriCache curves, when schedules are compared
MARKERS = {"snapkv": "o", "streaming_llm": "s", "kivi": "^", "knorm": "D", "h2o": "v"}  # one per compressor


def _ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def _mean_by(rows: list[dict], key: str) -> dict[str, float]:
    """Mean of `key` per method over the workloads where it was measured."""
    values: dict[str, list[float]] = {}
    for row in rows:
        if _ok(row.get(key)):
            values.setdefault(row["method"], []).append(row[key])
    return {name: mean(v) for name, v in values.items()}


def _panels(
    workloads: list[str], size: tuple[float, float] | None = None, **subplots: Any
) -> tuple[Any, dict[str, Any]]:
    """One figure with a panel per workload (up to four a row), so a grid run reads as small multiples rather
    than as one crowded axis; a single workload gets the plain 6x4 figure."""
    columns = min(4, len(workloads))
    rows = math.ceil(len(workloads) / columns)
    if size is None:
        size = (6, 4) if len(workloads) == 1 else (3.2 * columns + 2.8, 2.6 * rows + 0.6)
    fig = plt.figure(figsize=size, layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False, **subplots).flat)
    panels = dict(zip(workloads, axes, strict=False))
    for unused in axes[len(workloads) :]:
        unused.set_visible(False)
    if len(workloads) > 1:
        for name, ax in panels.items():
            ax.set_title(name, fontsize=9)
    return fig, panels


def plot_throughput(rows: list[dict], path: Path, key: str = "decode_ratio") -> Path:
    """A panel per workload: each compressor's speed at each ratio, lossy alone and as VeriCache's drafter."""
    fig, panels = _panels(workload_order(rows), sharey=True)
    for workload, ax in panels.items():
        ax.axhline(1.0, color=COLORS["full"], linestyle="--", label="full cache")
        curves: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for row in rows:
            if row["workload"] == workload and row["family"] in ("lossy", "vericache") and _ok(row.get(key)):
                family = row["family"] + (f"+{row['proposer']}" if row.get("proposer") else "")
                curve = curves.setdefault((family, row["compressor"], row.get("draft_schedule") or ""), [])
                curve.append((row["compression_ratio"], row[key]))
        for (family, compressor, schedule), points in sorted(curves.items()):
            label = f"{compressor} only (lossy)" if family == "lossy" else f"VeriCache ({compressor})"
            label += " + prompt lookup" if family.endswith("+prompt_lookup") else ""
            label += f" [{schedule}]" if schedule else ""
            style = "--" if family == "lossy" else SCHEDULE_STYLES.get(schedule, "-")
            marker = MARKERS.get(compressor, "o")
            ax.plot(
                *zip(*sorted(points), strict=True), style, marker=marker, color=COLORS[family], label=label
            )
    return _finish(
        fig,
        panels,
        path,
        xlabel="compression ratio (fraction of the KV cache removed)",
        ylabel="decode tokens/s relative to full cache",
        title="Throughput against compression ratio",
    )


def plot_quality(rows: list[dict], path: Path, key: str = "decode_ratio") -> Path:
    """Each method once, at its mean over the workloads: how often its output is the full-cache output, and
    how often its code parses, against its speed."""
    fig, panels = _panels(["all"], size=(8.5, 4.5))
    ax = panels["all"]
    speed = _mean_by(rows, key)
    identical = _mean_by(rows, "identical_share")
    parsed = _mean_by(rows, "parse_share")
    colors = _method_colors(rows)
    for name, x in speed.items():
        color = colors[name]
        if name in identical:
            ax.scatter(x, identical[name], color=color, marker="o", s=50, label=name, alpha=0.8)
        if name in parsed:
            ax.scatter(x, parsed[name], color=color, marker="^", s=40, alpha=0.6)
    ax.scatter([], [], color="gray", marker="o", label="(circle) identical to full-cache output")
    ax.scatter([], [], color="gray", marker="^", label="(triangle) code parses (ast.parse)")
    ax.set_ylim(-0.05, 1.1)
    title = "Quality against throughput" + (" (mean over workloads)" if len(workload_order(rows)) > 1 else "")
    return _finish(
        fig,
        panels,
        path,
        xlabel="decode tokens/s relative to full cache",
        ylabel="share of outputs",
        title=title,
        outside=True,
    )


def _method_colors(rows: list[dict]) -> dict[str, Any]:
    """A colour per method: a compressor at a ratio gets one hue, dark as VeriCache's drafter and light alone,
    so each lossless point pairs with the lossy point it replaces; full cache and the peers keep their own."""
    pairs = plt.get_cmap("tab20")
    settings = list(
        dict.fromkeys((r["compressor"], r["compression_ratio"]) for r in rows if r.get("compressor"))
    )
    colors = {}
    for row in rows:
        family = row["family"]
        if family in ("lossy", "vericache"):
            index = 2 * settings.index((row["compressor"], row["compression_ratio"])) + (family == "lossy")
            colors[row["method"]] = pairs(index % 20)
        else:
            colors[row["method"]] = COLORS.get(family, "gray")
    return colors


def plot_acceptance(rows: list[dict], path: Path) -> Path:
    """A panel per workload: accepted drafts per round over the first batch's generation, and the draft length
    the schedule chose (dotted)."""
    fig, panels = _panels(workload_order(rows), sharey=True)
    methods = list(dict.fromkeys(r["method"] for r in rows if r["family"] == "vericache"))
    palette = plt.get_cmap("tab10")
    for row in rows:
        series = row.get("accepted_per_round")
        if row["family"] == "vericache" and series:
            ax = panels[row["workload"]]
            color = palette(methods.index(row["method"]) % 10)
            ax.plot(range(1, len(series) + 1), series, marker=".", color=color, label=row["method"])
            lengths = row.get("draft_lengths") or []
            if lengths:
                ax.plot(range(1, len(lengths) + 1), lengths, linestyle=":", color=color, alpha=0.5)
    next(iter(panels.values())).plot([], [], linestyle=":", color="gray", label="draft length (same colour)")
    for ax in panels.values():
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole
    return _finish(
        fig,
        panels,
        path,
        xlabel="round",
        ylabel="accepted draft tokens (mean over rows)",
        title="Accepted tokens per round over a generation (first batch)",
    )


def _finish(
    fig, panels: dict[str, Any], path: Path, *, xlabel: str, ylabel: str, title: str, outside: bool = False
) -> Path:
    """The labels, title, one legend and grids every figure has; then save it to `path` and close it.
    The legend goes beside the axes when there are several panels, or when `outside`, so it hides no point."""
    handles: dict[str, Any] = {}
    for ax in panels.values():
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if len(panels) == 1:
        (ax,) = panels.values()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    else:
        fig.supxlabel(xlabel)
        fig.supylabel(ylabel)
        fig.suptitle(title)
    if len(panels) == 1 and not outside:
        ax.legend(handles.values(), handles.keys(), fontsize=7)
    else:
        fig.legend(handles.values(), handles.keys(), fontsize=7, loc="outside right upper")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(rows: list[dict], out_dir: Path) -> list[Path]:
    return [
        plot_throughput(rows, out_dir / "throughput_vs_ratio.png"),
        plot_quality(rows, out_dir / "quality_vs_throughput.png"),
        plot_acceptance(rows, out_dir / "acceptance_per_round.png"),
    ]
