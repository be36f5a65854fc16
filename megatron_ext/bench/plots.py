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
          "DCP async (process)": "tab:cyan", "DCP + DefaultStager": "tab:brown", "megatron-core async": "tab:purple",
          "DeepSpeed default": "tab:orange", "no checkpoints": "tab:gray"}
PHASE_COLORS = {"snapshot": "tab:green", "flush local": "tab:olive", "flush shared": "tab:blue",
                "commit": "tab:purple", "training blocked": "tab:red"}
#: A physical limit drawn beside the measured bars (a series whose name ends in "(limit)").
LIMIT_STYLE = {"color": "white", "edgecolor": "black", "hatch": "///", "linewidth": 0.8}


def grouped_bars(path: str, title: str, groups: Sequence[str], series: Mapping[str, Sequence[float | None]],
                 ylabel: str, xlabel: str = "", log: bool = False) -> str:
    """One group of bars per entry of ``groups``, one bar per series (None: not measured, left empty)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        style = LIMIT_STYLE if name.endswith("(limit)") else {"color": COLORS.get(name)}
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name, **style)
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


def timeline(path: str, title: str, bars: Sequence[tuple[str, str, float, float]], *,
             breaks: Sequence[tuple[float, str]] = (), separators: Sequence[tuple[float, str]] = (),
             ticks: Sequence[tuple[float, str]] | None = None) -> str:
    """Horizontal bars ``(row, phase, start, end)``: one row per rank, one colour per phase.

    ``training blocked`` bars are drawn thin, on top, at least a few pixels wide (they last
    milliseconds). ``breaks``: ``(x, label)`` where idle time was cut out of the axis (a dashed
    line and the seconds it stands for); ``separators``: ``(x, label)`` where a run starts (drawn
    when there are several); ``ticks``: the axis positions labelled with the real time there.
    """
    rows = sorted({row for row, *_ in bars}, key=_natural)
    fig, ax = plt.subplots(figsize=(10.0, max(2.8, 0.45 * len(rows) + 1.8)))
    seen: set[str] = set()
    span = max((e for *_, e in bars), default=1.0) - min((s for _, _, s, _ in bars), default=0.0)
    visible = span / 400  # the narrowest bar drawn: about two pixels
    for row, phase, start, end in sorted(bars, key=lambda b: b[1] == "training blocked"):
        blocked = phase == "training blocked"
        ax.barh(rows.index(row) + (0.22 if blocked else 0.0), max(end - start, visible if blocked else 1e-4),
                left=start, height=0.16 if blocked else 0.6, color=PHASE_COLORS.get(phase, "tab:gray"),
                label=None if phase in seen else phase, alpha=1.0 if blocked else 0.85,
                edgecolor="none" if blocked else "white", linewidth=0.6, zorder=3 if blocked else 2)
        seen.add(phase)
    for x, label in breaks:
        ax.axvline(x, color="0.4", linestyle=(0, (2, 2)), linewidth=0.9, zorder=1)
        ax.annotate(f"// {label}", (x, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7, color="0.3")
    if len(separators) > 1:
        for x, label in separators:
            ax.axvline(x, color="black", linewidth=1.2, zorder=1)
            ax.annotate(label, (x, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 3),
                        textcoords="offset points", ha="left", va="bottom", fontsize=8, fontweight="bold")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.8)
    if ticks:
        ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=7)
    xlabel = "seconds since the first checkpoint started" + (" (idle stretches cut out)" if breaks else "")
    _finish(ax, title, xlabel, "", log=False)
    if breaks:
        ax.set_title(title, fontsize=10, pad=16)  # room for the break labels above the axes
    return _save(fig, path)


def _finish(ax, title: str, xlabel: str, ylabel: str, log: bool) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # outside the axes, so it never covers data
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the title and the outside legend too
    plt.close(fig)
    return path


def _short(v: float) -> str:
    """Three significant digits, trailing zeros kept (a ratio of 1.004 reads 1.00, not 1)."""
    return f"{v:#.3g}".rstrip(".")


def _natural(row: str) -> tuple:
    digits = "".join(c for c in row if c.isdigit())
    return (row.rstrip("0123456789"), int(digits) if digits else 0)
