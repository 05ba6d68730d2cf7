"""Pareto fronts of a sweep: which configurations no other one beats on two measures.

``pareto_mask`` and ``mark_pareto`` are pure Python; ``plot_pareto`` draws scatter panels
with the fronts highlighted, and ``plot_sweep`` the two that ``kvloop sweep`` writes (output
throughput against p99 TTFT, goodput against cost in GPUs), with matplotlib through Agg
directly (no pyplot: no window, no global state; matplotlib is imported only to draw).

A sweep row is a dict with the columns ``kvloop sweep`` writes; these use ``error``,
``gpus``, ``output_tok_s``, ``goodput_req_s``, ``ttft_p99_s``, ``slo_ttft_s`` and
``slo_tpot_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Panel", "mark_pareto", "pareto_mask", "plot_pareto", "plot_sweep"]


def pareto_mask(xs: Sequence[float], ys: Sequence[float]) -> list[bool]:
    """For each point, whether it is Pareto-optimal when a smaller x and a larger y are
    better: no other point is at least as good on both and strictly better on one.

    Identical points are all optimal (none strictly beats another). O(n log n)."""
    order = sorted(range(len(xs)), key=lambda i: (xs[i], -ys[i]))
    mask = [False] * len(xs)
    best_y = float("-inf")  # the largest y among points with a strictly smaller x
    group_x, group_best = None, float("-inf")  # the points sharing the current x
    for i in order:
        if xs[i] != group_x:
            best_y = max(best_y, group_best)
            group_x, group_best = xs[i], ys[i]  # NOTE: first of its x has the largest y
        # optimal: the best y at its x, and above every y at smaller x
        mask[i] = ys[i] == group_best and ys[i] > best_y
    return mask


@dataclass(frozen=True)
class Panel:
    """One scatter panel: points (x, y) where a smaller x and a larger y are better."""

    xs: Sequence[float]
    ys: Sequence[float]
    xlabel: str
    ylabel: str
    title: str


def mark_pareto(rows: list[dict[str, Any]]) -> None:
    """Set ``pareto_ttft`` (no row has more output throughput at no worse p99 TTFT) and
    ``pareto_cost`` (no row has more goodput on no more GPUs): True/False on the rows that
    succeeded, None on the others."""
    for column, x, y in (("pareto_ttft", "ttft_p99_s", "output_tok_s"),
                         ("pareto_cost", "gpus", "goodput_req_s")):
        ok = [i for i, r in enumerate(rows)
              if not r["error"] and r[x] is not None and r[y] is not None]
        for row in rows:
            row[column] = None
        mask = pareto_mask([rows[i][x] for i in ok], [rows[i][y] for i in ok])
        for i, best in zip(ok, mask, strict=True):
            rows[i][column] = best


def _draw(ax: Axes, panel: Panel, labels: Sequence[str]) -> None:
    mask = pareto_mask(panel.xs, panel.ys)
    rest = [i for i, m in enumerate(mask) if not m]
    front = sorted((i for i, m in enumerate(mask) if m), key=lambda i: panel.xs[i])
    ax.scatter([panel.xs[i] for i in rest], [panel.ys[i] for i in rest], s=25,
               color="#b0b0b0", label="dominated", zorder=2)
    ax.step([panel.xs[i] for i in front], [panel.ys[i] for i in front], where="post",
            color="#d95f02", alpha=0.5, zorder=1)
    ax.scatter([panel.xs[i] for i in front], [panel.ys[i] for i in front], s=45,
               color="#d95f02", edgecolor="black", label="Pareto-optimal", zorder=3)
    tied: dict[tuple[float, float], list[int]] = {}  # one label per spot on the front
    for i in front:
        tied.setdefault((panel.xs[i], panel.ys[i]), []).append(i)
    for k, (spot, same) in enumerate(tied.items()):
        more = f" (+{len(same) - 1} tied)" if len(same) > 1 else ""
        # NOTE: along the front y rises with x: of two close points the later is the higher,
        # so labels alternate below, above (each on its own point's side)
        ax.annotate(labels[same[0]] + more, spot, fontsize=7,
                    xytext=(6, -12 if k % 2 == 0 else 6), textcoords="offset points")
    positive = [x for x in panel.xs if x > 0]
    if positive and len(positive) == len(panel.xs) and max(positive) > 20 * min(positive):
        ax.set_xscale("log")
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.12, y=0.12)  # room for the labels
    ax.legend(fontsize=8, loc="best")


def plot_pareto(panels: Sequence[Panel], labels: Sequence[str], path: str,
                title: str = "") -> None:
    """Write a PNG with one panel per ``Panel`` side by side; Pareto-optimal points are
    coloured, joined by their front and labelled with ``labels`` (one per point)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0 * len(panels), 5.5))
    FigureCanvasAgg(fig)  # NOTE: Agg directly, never pyplot (as viz.timeline)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        _draw(ax, panel, labels)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")  # NOTE: keeps labels past the edge


def plot_sweep(rows: list[dict[str, Any]], labels: Sequence[str], path: str,
               title: str = "") -> bool:
    """The sweep's PNG: throughput vs p99 TTFT, and goodput vs GPUs, over the rows
    ``mark_pareto`` marked (those that succeeded), each labelled with its ``labels`` entry.
    False, and no file, when no row succeeded."""
    ok = [i for i, r in enumerate(rows) if r.get("pareto_ttft") is not None]
    if not ok:
        return False
    pick = [rows[i] for i in ok]
    slo = any(r["slo_ttft_s"] is not None or r["slo_tpot_s"] is not None for r in pick)
    plot_pareto([
        Panel([r["ttft_p99_s"] for r in pick], [r["output_tok_s"] for r in pick],
              "p99 TTFT (s)", "output throughput (tok/s)", "throughput vs tail latency"),
        Panel([r["gpus"] for r in pick], [r["goodput_req_s"] for r in pick],
              "cost (GPUs = replicas x tensor-parallel size)",
              "goodput (req/s)" if slo else "goodput (req/s; no SLO given: every request)",
              "goodput vs cost"),
    ], [labels[i] for i in ok], path, title)
    return True
