"""The step timeline picture: the seed picture of continuous batching.

One row per request, one column per step, each cell coloured by what the request did in
that step (see ``viz.grid.LEGEND``). Panels under the grid share its step axis: tokens per
step against the budget, KV blocks used against the pool, running/waiting/swapped counts,
and step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from kvloop.viz.grid import LEGEND, Cell, TimelineGrid

__all__ = ["DPI", "FIGSIZE", "TimelineGeometry", "plot_timeline"]

FIGSIZE = (16.0, 11.0)
"""Figure size in inches; with ``DPI`` the PNG is always 1600 x 1100 pixels."""
DPI = 100
_MAX_LABELS = 50
"""Most request ids written on the y axis (every k-th row beyond that)."""


@dataclass(frozen=True)
class TimelineGeometry:
    """Where the grid landed in the PNG, in image pixels (origin top-left, y down)."""

    width_px: int
    height_px: int
    left: float
    top: float
    right: float
    bottom: float
    """Edges of the grid's axes box: column c spans ``[c, c+1) * cell width`` from left."""
    num_rows: int
    num_cols: int

    def cell_point(self, row: int, col: int, fx: float = 0.5, fy: float = 0.5) -> tuple[int, int]:
        """Pixel ``(x, y)`` at fraction ``(fx, fy)`` inside cell ``(row, col)``."""
        w = (self.right - self.left) / self.num_cols
        h = (self.bottom - self.top) / self.num_rows
        return int(self.left + (col + fx) * w), int(self.top + (row + fy) * h)


def _colormap() -> ListedColormap:
    return ListedColormap([LEGEND[c][1] for c in Cell])


def _draw_grid(ax, grid: TimelineGrid, cell_w: float, cell_h: float) -> None:
    rows = grid.cells.shape[0]
    ax.imshow(
        grid.cells, cmap=_colormap(), vmin=-0.5, vmax=len(Cell) - 0.5,
        aspect="auto", interpolation="nearest", origin="upper",
    )
    step = max(1, math.ceil(rows / _MAX_LABELS))
    ax.set_yticks(range(0, rows, step))
    ax.set_yticklabels(grid.request_ids[::step], fontsize=6 if rows > 30 else 8)
    ax.set_ylabel("request")
    # Token counts on prefill/recompute cells when a number fits in the cell.
    if cell_h >= 9:
        fontsize = min(8.0, cell_h * 0.55)
        for r, c in zip(*np.nonzero(grid.cells >= Cell.PREFILL), strict=True):
            if grid.cells[r, c] not in (Cell.PREFILL, Cell.RECOMPUTE):
                continue
            text = str(int(grid.tokens[r, c]))
            if len(text) * fontsize * 0.75 + 2 > cell_w:
                continue
            ax.text(c, r, text, ha="center", va="center", fontsize=fontsize, color="white")


def _draw_panels(axes, grid: TimelineGrid) -> None:
    recs = grid.records
    x = np.arange(len(recs))
    style = {"drawstyle": "steps-mid", "linewidth": 1.0}
    ax = axes[0]
    ax.plot(x, [r.num_batched_tokens for r in recs], color="#1f5fb4", label="tokens", **style)
    ax.plot(x, [r.token_budget for r in recs], "--", color="#555555", label="budget", lw=1)
    ax.set_ylabel("tokens")
    ax = axes[1]
    ax.plot(x, [r.kv_blocks_used for r in recs], color="#9467bd", label="used", **style)
    ax.plot(x, [r.num_gpu_blocks for r in recs], "--", color="#555555", label="pool", lw=1)
    ax.set_ylabel("KV blocks")
    ax = axes[2]
    for name, color in (("running", "#2ca02c"), ("waiting", "#c9a500"), ("swapped", "#9467bd")):
        ax.plot(x, [getattr(r, f"num_{name}") for r in recs], color=color, label=name, **style)
    ax.set_ylabel("requests")
    ax = axes[3]
    ax.plot(x, [1000.0 * r.step_time_s for r in recs], color="#d62728", label="step", **style)
    ax.set_ylabel("step ms")
    for ax in axes:
        top = ax.dataLim.y1 if np.isfinite(ax.dataLim.y1) else 0.0
        ax.set_ylim(0, max(top, 1e-9) * 1.4)  # headroom for the legend
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=3, framealpha=0.7)


def plot_timeline(grid: TimelineGrid, path: str, *, title: str | None = None) -> TimelineGeometry:
    """Draw ``grid`` and its panels to a PNG at ``path``; return where the grid landed."""
    rows, cols = grid.cells.shape
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)  # NOTE: Agg directly, never pyplot: no window, no global state
    axes = fig.subplots(
        5, 1, sharex=True,
        gridspec_kw={"height_ratios": [5, 1, 1, 1, 1], "hspace": 0.12,
                     "left": 0.1, "right": 0.98, "top": 0.93, "bottom": 0.05},
    )
    width_px, height_px = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)
    box = axes[0].get_position()
    # NOTE: fixed margins (no tight/constrained layout), so the box is final before drawing.
    geom = TimelineGeometry(
        width_px, height_px,
        left=box.x0 * width_px, top=(1 - box.y1) * height_px,
        right=box.x1 * width_px, bottom=(1 - box.y0) * height_px,
        num_rows=rows, num_cols=cols,
    )
    cell_w = (geom.right - geom.left) / cols
    cell_h = (geom.bottom - geom.top) / rows
    _draw_grid(axes[0], grid, cell_w, cell_h)
    _draw_panels(axes[1:], grid)
    steps = grid.steps
    axes[-1].set_xlim(-0.5, cols - 0.5)
    axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    axes[-1].xaxis.set_major_formatter(
        FuncFormatter(lambda v, _: str(steps[int(v)]) if 0 <= v < cols and v == int(v) else "")
    )
    axes[-1].set_xlabel("step")
    t0, t1 = grid.records[0].time_s, grid.records[-1].end_time_s
    fig.suptitle(
        title or f"kvloop step timeline: steps {steps[0]}–{steps[-1]} "
        f"({cols} of {grid.total_steps}), {rows} of {grid.total_requests} requests, "
        f"t = {t0:.3f}–{t1:.3f} s",
        fontsize=11, y=0.995,
    )
    handles = [Patch(facecolor=color, edgecolor="#888888", label=label)
               for label, color in LEGEND.values()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.54, 0.972), frameon=False)
    fig.savefig(path, dpi=DPI)
    return geom
