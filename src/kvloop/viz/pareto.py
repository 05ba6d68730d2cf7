"""Pareto fronts of a sweep: which configurations no other one beats on two measures.

``pareto_mask`` and ``mark_pareto`` are pure Python; ``plot_pareto`` draws scatter panels
with the fronts highlighted and every point numbered (a key under the panels names each
number), and ``plot_sweep`` the two that ``kvloop sweep`` writes (output
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
    from matplotlib.figure import Figure

__all__ = [
    "KEY_MAX", "Panel", "mark_pareto", "pareto_figure", "pareto_mask", "plot_pareto",
    "plot_sweep",
]


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


KEY_MAX = 120
"""Most points the key under a picture lists by name; beyond, it says where to look."""
_NEAR = 0.03
"""Points closer than this (fraction of the panel's width and height) share one mark."""


def _marks(ax: Axes, xs: Sequence[float], ys: Sequence[float], front: Sequence[int],
           rest: Sequence[int]) -> tuple[dict[tuple[float, float], list[int]],
                                          dict[tuple[float, float], list[int]],
                                          list[list[int]]]:
    """Who shares a mark in ``ax`` (its final scale and limits): the front's points by spot
    (identical points tie), the dominated points within ``_NEAR`` of a front spot (the
    nearest), and the other dominated points in groups within ``_NEAR`` of their first."""
    ax.get_xlim()  # NOTE: settles the autoscaled limits that transData reads

    def where(i: int) -> tuple[float, float]:
        u, v = ax.transAxes.inverted().transform(ax.transData.transform((xs[i], ys[i])))
        return float(u), float(v)

    tied: dict[tuple[float, float], list[int]] = {}
    for i in front:
        tied.setdefault((xs[i], ys[i]), []).append(i)
    near: dict[tuple[float, float], list[int]] = {spot: [] for spot in tied}
    anchors = [(where(same[0]), spot) for spot, same in tied.items()]
    groups: list[tuple[tuple[float, float], list[int]]] = []
    for i in rest:
        u, v = where(i)
        close = [(max(abs(u - a), abs(v - b)), spot) for (a, b), spot in anchors
                 if abs(u - a) < _NEAR and abs(v - b) < _NEAR]
        if close:
            near[min(close)[1]].append(i)
            continue
        for (a, b), members in groups:
            if abs(u - a) < _NEAR and abs(v - b) < _NEAR:
                members.append(i)
                break
        else:
            groups.append(((u, v), [i]))
    return tied, near, [members for _, members in groups]


def _draw(ax: Axes, panel: Panel, labels: Sequence[str], ids: Sequence[str]) -> None:
    mask = pareto_mask(panel.xs, panel.ys)
    rest = [i for i, m in enumerate(mask) if not m]
    front = sorted((i for i, m in enumerate(mask) if m), key=lambda i: panel.xs[i])
    ax.scatter([panel.xs[i] for i in rest], [panel.ys[i] for i in rest], s=25,
               color="#b0b0b0", label="dominated", zorder=2)
    ax.step([panel.xs[i] for i in front], [panel.ys[i] for i in front], where="post",
            color="#d95f02", alpha=0.5, zorder=1)
    ax.scatter([panel.xs[i] for i in front], [panel.ys[i] for i in front], s=45,
               color="#d95f02", edgecolor="black", label="Pareto-optimal", zorder=3)
    positive = [x for x in panel.xs if x > 0]
    if positive and len(positive) == len(panel.xs) and max(positive) > 20 * min(positive):
        ax.set_xscale("log")
    ax.margins(x=0.12, y=0.12)  # room for the labels
    if min(panel.ys, default=0.0) >= 0:  # NOTE: from zero: 707 vs 714 tok/s must look alike
        ax.set_ylim(bottom=0.0)
    tied, near, groups = _marks(ax, panel.xs, panel.ys, front, rest)

    def marks(points: Sequence[int]) -> str:
        return " ".join(f"#{ids[j]}" for j in points)

    for k, (spot, same) in enumerate(tied.items()):  # the front: one label per spot
        more = (f" (tied: {marks(same[1:])})" if len(same) > 1 else "") + (
            f" (near: {marks(near[spot])})" if near[spot] else "")
        # NOTE: along the front y rises with x: of two close points the later is the higher,
        # so labels alternate below, above (each on its own point's side)
        ax.annotate(f"#{ids[same[0]]} {labels[same[0]]}".rstrip() + more, spot, fontsize=7,
                    xytext=(6, -12 if k % 2 == 0 else 6), textcoords="offset points")
    for group in groups:  # the dominated points away from the front: their numbers
        ax.annotate(marks(group), (panel.xs[group[0]], panel.ys[group[0]]), fontsize=6,
                    color="#606060", xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def _key(ids: Sequence[str], labels: Sequence[str], title: str, width: int = 230) -> str:
    """The key under the panels: ``#id label`` for every point, in columns that fit about
    ``width`` characters; one line instead when there are more than ``KEY_MAX`` points."""
    head = [title] if title else []
    if len(ids) > KEY_MAX:
        return "\n".join([*head, f"({len(ids)} points: too many to list here)"])
    entries = [f"#{i} {label}".rstrip() for i, label in zip(ids, labels, strict=True)]
    cell = max(len(e) for e in entries) + 3
    cols = max(1, min(4, width // cell))
    per = -(-len(entries) // cols)
    lines = ["".join(e.ljust(cell) for e in entries[r::per]).rstrip() for r in range(per)]
    return "\n".join([*head, *lines])


def pareto_figure(panels: Sequence[Panel], labels: Sequence[str], title: str = "",
                  ids: Sequence[str] | None = None, key_title: str = "") -> Figure:
    """The figure of ``plot_pareto`` (see there), not yet written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ids = [str(k) for k in range(1, len(labels) + 1)] if ids is None else list(ids)
    fig = Figure(figsize=(7.0 * len(panels), 5.5))
    FigureCanvasAgg(fig)  # NOTE: Agg directly, never pyplot (as viz.timeline)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        _draw(ax, panel, labels, ids)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if labels:  # NOTE: below the panels; savefig's tight box takes it in
        fig.text(0.01, -0.01, _key(ids, labels, key_title), ha="left", va="top",
                 fontsize=7, family="monospace", gid="pareto-key")
    return fig


def plot_pareto(panels: Sequence[Panel], labels: Sequence[str], path: str,
                title: str = "", ids: Sequence[str] | None = None,
                key_title: str = "") -> None:
    """Write a PNG with one panel per ``Panel`` side by side. Every point is marked with its
    id (``ids``, one per point; default 1, 2, ...), the Pareto-optimal ones coloured,
    joined by their front and labelled ``#id label``; dominated points carry their ``#id``
    alone, or are named in the label of a front point they would overlap ("near: #id"),
    and points that would overlap share one mark. A key under the panels, headed
    ``key_title``, maps each id to its label."""
    fig = pareto_figure(panels, labels, title, ids, key_title)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # NOTE: keeps labels past the edge


def plot_sweep(rows: list[dict[str, Any]], labels: Sequence[str], path: str,
               title: str = "") -> bool:
    """The sweep's PNG: throughput vs p99 TTFT, and goodput vs GPUs, over the rows
    ``mark_pareto`` marked (those that succeeded). Each point is marked ``#k``, its row's
    number (the k-th row of the CSV and JSON, ``#`` in the console table), and the key
    names it by its ``labels`` entry. False, and no file, when no row succeeded."""
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
    ], [labels[i] for i in ok], path, title, ids=[str(i + 1) for i in ok],
        key_title="#k: the k-th configuration (row k of the table)")
    return True
