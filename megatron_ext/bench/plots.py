"""PNG figures in the paper's style (grouped bars per size and approach, lines over frequency, timelines).

matplotlib runs headless (Agg) so the benchmarks and ``telemetry report`` work on compute nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

#: One colour per approach, the same in every figure.
COLORS = {"datastates": "tab:green", "torch.save": "tab:red", "DCP async (thread)": "tab:blue",
          "DCP async (process)": "tab:cyan", "megatron-core async": "tab:purple",
          "DeepSpeed default": "tab:orange", "no checkpoints": "tab:gray"}
PHASE_COLORS = {"snapshot": "tab:green", "flush local": "tab:olive", "flush shared": "tab:blue",
                "commit": "tab:purple"}


def grouped_bars(path: str, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float | None]],
                 ylabel: str, xlabel: str = "", log: bool = False) -> str:
    """One group of bars per entry of ``groups``, one bar per series (None: not measured, left empty)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name, color=COLORS.get(name))
        if len(groups) <= 12:  # values on the bars while they stay readable
            ax.bar_label(bars, labels=[_short(v) for _, v in kept], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    _finish(ax, title, xlabel, ylabel, log)
    return _save(fig, path)


def lines(path: str, title: str, xs: Sequence[float], series: Mapping[str, Sequence[float | None]],
          xlabel: str, ylabel: str, xlabels: Sequence[str] | None = None, log: bool = False) -> str:
    """One line with markers per series over ``xs`` (``log``: logarithmic y axis)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, values in series.items():
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        ax.plot([x for x, _ in kept], [v for _, v in kept], marker="o", label=name, color=COLORS.get(name))
    ax.set_xticks(list(xs), list(xlabels) if xlabels is not None else [str(x) for x in xs])
    _finish(ax, title, xlabel, ylabel, log=log)
    return _save(fig, path)


def timeline(path: str, title: str, bars: Sequence[tuple[str, str, float, float]]) -> str:
    """Horizontal bars ``(row, phase, start_s, end_s)``: one row per rank, one colour per phase."""
    rows = sorted({row for row, *_ in bars}, key=_natural)
    fig, ax = plt.subplots(figsize=(9.0, max(2.5, 0.45 * len(rows) + 1.5)))
    seen: set[str] = set()
    for row, phase, start, end in bars:
        ax.barh(rows.index(row), max(end - start, 1e-4), left=start, height=0.6,
                color=PHASE_COLORS.get(phase, "tab:gray"), label=None if phase in seen else phase, alpha=0.85,
                edgecolor="white", linewidth=0.6)
        seen.add(phase)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    _finish(ax, title, "seconds since the first checkpoint started", "", log=False)
    return _save(fig, path)


def _finish(ax, title: str, xlabel: str, ylabel: str, log: bool) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(v: float) -> str:
    return f"{v:.3g}"


def _natural(row: str) -> tuple:
    digits = "".join(c for c in row if c.isdigit())
    return (row.rstrip("0123456789"), int(digits) if digits else 0)
