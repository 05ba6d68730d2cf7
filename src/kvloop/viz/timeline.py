"""The step timeline picture: the seed picture of continuous batching.

One row per request, each cell coloured by what the request did in a step (see
``viz.grid.LEGEND``). Panels under the grid share its x axis: tokens per step against the
budget, KV blocks used against the pool, running/waiting/swapped counts, and step time.

The x axis is time by default: seconds since the trace's first arrival, each step as wide
as it took (a 20 s step twenty times as wide as a 1 s one), gaps between steps drawn with
the state each request carried through them, and a request that arrived in the middle of
a step shown waiting from its arrival on. ``x_axis="step"`` gives every step one column.
Rows are labelled with a row number (order of first sight in the trace) and a short id,
then the tenant and priority the request arrived with (when the trace recorded them). A
request that missed its TTFT target gets a marker at its deadline (arrival + target).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from kvloop.core.stats import StepRecord
from kvloop.viz.grid import LEGEND, Cell, TimelineGrid

__all__ = [
    "DPI", "FIGSIZE", "MISSED_TTFT", "X_AXES", "TimelineGeometry", "default_title",
    "plot_timeline",
]

FIGSIZE = (16.0, 11.0)
"""Figure size in inches; with ``DPI`` the PNG is always 1600 x 1100 pixels."""
DPI = 100
X_AXES = ("time", "step")
"""What the x axis counts: seconds since the first arrival, or steps."""
_MAX_LABELS = 50
"""Most row labels written on the y axis (every k-th row beyond that)."""
_MARGIN = {"right": 0.98, "top": 0.93, "bottom": 0.05}
MISSED_TTFT = ("missed TTFT (at deadline)", "#e7298a")
"""Legend label and colour of the marker at a late request's TTFT deadline."""
_MIN_GAP = 1e-3
"""Gaps between steps shorter than this share of the window are drawn as part of the step
before (they would be under a pixel wide)."""

# What a request is doing between two steps, from what it did in the step before.
_CARRY = np.zeros(len(Cell), dtype=np.int8)
for _cell, _between in {
    Cell.WAITING: Cell.WAITING, Cell.PREEMPTED: Cell.WAITING, Cell.IDLE: Cell.IDLE,
    Cell.PREFILL: Cell.IDLE, Cell.RECOMPUTE: Cell.IDLE, Cell.DECODE: Cell.IDLE,
    Cell.SWAPPED: Cell.SWAPPED,
}.items():
    _CARRY[_cell] = _between


@dataclass(frozen=True)
class TimelineGeometry:
    """Where the grid landed in the PNG, in image pixels (origin top-left, y down)."""

    width_px: int
    height_px: int
    left: float
    top: float
    right: float
    bottom: float
    """Edges of the grid's axes box."""
    num_rows: int
    num_cols: int
    x_min: float = -0.5
    x_max: float = 0.5
    """Data x at the box's left and right edges (seconds or step columns)."""
    col_edges: tuple[tuple[float, float], ...] = ()
    """Data x where each step's column starts and ends."""
    ttft_marks: tuple[tuple[int, float], ...] = ()
    """(row, data x) of each missed-TTFT marker drawn (``MISSED_TTFT``)."""

    def x_px(self, x: float) -> float:
        """Pixel x of data x."""
        return self.left + (x - self.x_min) / (self.x_max - self.x_min) * (self.right - self.left)

    def col_px(self, col: int) -> tuple[float, float]:
        """Pixel x where step column ``col`` starts and ends."""
        a, b = self.col_edges[col]
        return self.x_px(a), self.x_px(b)

    def cell_point(self, row: int, col: int, fx: float = 0.5, fy: float = 0.5) -> tuple[int, int]:
        """Pixel ``(x, y)`` at fraction ``(fx, fy)`` inside cell ``(row, col)``."""
        a, b = self.col_px(col)
        h = (self.bottom - self.top) / self.num_rows
        return int(a + fx * (b - a)), int(self.top + (row + fy) * h)


@dataclass
class _Columns:
    """The drawn columns: steps, and (on a time axis) the gaps between them."""

    edges: np.ndarray
    """x of every drawn column's edges (one more than columns)."""
    cells: np.ndarray
    """``Cell`` values per row and drawn column."""
    step_col: list[int]
    """Drawn column of each step."""
    x_min: float
    x_max: float


def _duration(rec: StepRecord) -> float:
    span = rec.end_time_s - rec.time_s
    return span if span > 0 else max(rec.step_time_s, 0.0)


def _time_columns(grid: TimelineGrid) -> _Columns:
    recs, t0 = grid.records, grid.t0
    edges = [recs[0].time_s - t0]
    # NOTE: a gap under a pixel or so cannot be drawn truthfully: it joins the step before.
    min_gap = _MIN_GAP * (recs[-1].end_time_s - recs[0].time_s)
    cols: list[np.ndarray] = []
    step_col: list[int] = []
    for c, rec in enumerate(recs):
        start = rec.time_s - t0
        if c and start > edges[-1] + min_gap:  # a gap: every request keeps its state
            cols.append(_CARRY[grid.cells[:, c - 1]])
            edges.append(start)
        elif c:
            edges[-1] = max(edges[-1], start)
        step_col.append(len(cols))
        cols.append(grid.cells[:, c])
        edges.append(max(start + _duration(rec), edges[-1]))
    cells = np.stack(cols, axis=1) if cols else grid.cells
    starts = [float(a) - t0 for _, a, _ in recs[0].arrived]  # just before the window
    x_min = min([edges[0], *starts])
    return _Columns(np.asarray(edges), cells, step_col, x_min, max(edges[-1], x_min + 1e-6))


def _step_columns(grid: TimelineGrid) -> _Columns:
    cols = grid.cells.shape[1]
    return _Columns(np.arange(cols + 1) - 0.5, grid.cells, list(range(cols)), -0.5, cols - 0.5)


def _colormap() -> ListedColormap:
    return ListedColormap([LEGEND[c][1] for c in Cell])


def _waiting_bars(grid: TimelineGrid, cols: _Columns) -> list[tuple[int, float, float]]:
    """(row, from, to) for requests that arrived before the step where their row starts:
    they waited from their arrival, maybe in the middle of a long step."""
    bars = []
    started = cols.cells != Cell.NONE
    for r, arrival in enumerate(grid.arrivals):
        if arrival is None or not started[r].any():
            continue
        begin = cols.edges[int(np.argmax(started[r]))]
        a = max(arrival - grid.t0, cols.x_min)
        if a < begin:
            bars.append((r, a, float(begin)))
    return bars


def _draw_grid(ax, grid: TimelineGrid, cols: _Columns, geom: TimelineGeometry,
               fontsize: float) -> None:
    rows = grid.cells.shape[0]
    ax.pcolormesh(cols.edges, np.arange(rows + 1) - 0.5, cols.cells, cmap=_colormap(),
                  vmin=-0.5, vmax=len(Cell) - 0.5, shading="flat", antialiased=False,
                  edgecolors="none")
    bars = _waiting_bars(grid, cols)
    if bars:
        ax.barh([r for r, _, _ in bars], [b - a for _, a, b in bars],
                left=[a for _, a, _ in bars], height=1.0, color=LEGEND[Cell.WAITING][1],
                linewidth=0)
    ax.set_ylim(rows - 0.5, -0.5)
    step = max(1, -(-rows // _MAX_LABELS))
    ax.set_yticks(range(0, rows, step))
    ax.set_yticklabels(grid.labels()[::step], fontsize=fontsize, family="monospace")
    ax.set_ylabel(grid.label_title())
    # Token counts on prefill/recompute cells when a number fits in the cell.
    cell_h = (geom.bottom - geom.top) / rows
    if cell_h < 9:
        return
    size = min(8.0, cell_h * 0.55)
    for r, c in zip(*np.nonzero(np.isin(grid.cells, (Cell.PREFILL, Cell.RECOMPUTE))),
                    strict=True):
        a, b = geom.col_px(int(c))
        text = str(int(grid.tokens[r, c]))
        if len(text) * size * 0.75 + 2 > b - a:
            continue
        x = (geom.col_edges[c][0] + geom.col_edges[c][1]) / 2
        ax.text(x, r, text, ha="center", va="center", fontsize=size, color="white")


def _ttft_marks(grid: TimelineGrid, cols: _Columns, x_axis: str) -> list[tuple[int, float]]:
    """(row, x) of the TTFT deadline of each request that missed it, where the deadline
    falls inside the window. On the step axis a deadline sits in the step that ran at that
    time, as far into its column as into the step (between steps: at the column edge)."""
    recs = grid.records
    if x_axis == "time":
        def to_x(t: float) -> float:
            return t - grid.t0
    else:
        times = np.ravel([(r.time_s, max(r.end_time_s, r.time_s)) for r in recs])
        edges = np.ravel([(c - 0.5, c + 0.5) for c in range(len(recs))])

        def to_x(t: float) -> float:
            return float(np.interp(t, times, edges))
    lo, hi = recs[0].time_s, recs[-1].end_time_s
    marks = []
    for r, info in enumerate(grid.infos):
        t = info.ttft_deadline
        if info.missed_ttft and t is not None and lo <= t <= hi:
            x = to_x(t)
            if cols.x_min <= x <= cols.x_max:
                marks.append((r, x))
    return marks


def _draw_ttft_marks(ax, marks: list[tuple[int, float]], rows: int) -> None:
    size = max(3.0, min(9.0, 600.0 / max(rows, 1)))
    ax.plot([x for _, x in marks], [r for r, _ in marks], linestyle="none", marker="v",
            markersize=size, markerfacecolor=MISSED_TTFT[1], markeredgecolor="black",
            markeredgewidth=0.6, zorder=5)


def _panel_values(grid: TimelineGrid, cols: _Columns) -> dict[str, np.ndarray]:
    """Per drawn column: each step's values; in a gap, no tokens and no step time (0), and
    the KV blocks and queues of the step before."""
    recs = grid.records
    n = cols.cells.shape[1]
    names = ("num_batched_tokens", "token_budget", "kv_blocks_used", "num_gpu_blocks",
             "num_running", "num_waiting", "num_swapped")
    out = {name: np.zeros(n) for name in (*names, "step_ms")}
    for c, rec in enumerate(recs):
        j = cols.step_col[c]
        end = cols.step_col[c + 1] if c + 1 < len(recs) else n
        for name in names:
            out[name][j:end] = getattr(rec, name)
        out["step_ms"][j] = 1000.0 * rec.step_time_s
        out["step_ms"][j + 1:end] = 0
        out["num_batched_tokens"][j + 1:end] = 0
    return out


def _draw_panels(axes, cols: _Columns, values: dict[str, np.ndarray]) -> None:
    edges = cols.edges

    def line(ax, name: str, color: str, label: str, dashed: bool = False,
             fill: bool = False) -> None:
        ax.stairs(values[name], edges, baseline=0 if fill else None, fill=fill, color=color,
                  label=label, linewidth=1.0, linestyle="--" if dashed else "-")

    line(axes[0], "num_batched_tokens", "#1f5fb4", "tokens")
    line(axes[0], "token_budget", "#555555", "budget", dashed=True)
    axes[0].set_ylabel("tokens")
    line(axes[1], "kv_blocks_used", "#9467bd", "used")
    line(axes[1], "num_gpu_blocks", "#555555", "pool", dashed=True)
    axes[1].set_ylabel("KV blocks")
    for name, color in (("running", "#2ca02c"), ("waiting", "#c9a500"), ("swapped", "#9467bd")):
        line(axes[2], f"num_{name}", color, name)
    axes[2].set_ylabel("requests")
    line(axes[3], "step_ms", "#e8878a", "step", fill=True)  # area: time in steps
    axes[3].set_ylabel("step ms")
    for ax, keys in zip(axes, (("num_batched_tokens", "token_budget"),
                               ("kv_blocks_used", "num_gpu_blocks"),
                               ("num_running", "num_waiting", "num_swapped"), ("step_ms",)),
                        strict=True):
        top = max(float(values[k].max(initial=0.0)) for k in keys)
        ax.set_ylim(0, max(top, 1e-9) * 1.4)  # headroom for the legend
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=3, framealpha=0.7)


def _left_margin(labels: list[str], fontsize: float) -> float:
    """Room for the longest row label (monospace: ~0.6 em a character), the tick marks and
    the axis title, as a fraction of the figure width."""
    chars = max(map(len, labels), default=1)
    px = chars * fontsize * DPI / 72 * 0.62 + 48
    return min(0.3, max(0.05, px / (FIGSIZE[0] * DPI)))


def default_title(grid: TimelineGrid) -> str:
    """What the picture shows: steps, requests, and when (seconds since the first arrival)."""
    rows, cols = grid.cells.shape
    steps = grid.steps
    t_first = grid.records[0].time_s - grid.t0
    t_last = grid.records[-1].end_time_s - grid.t0
    return (f"kvloop step timeline: steps {steps[0]}–{steps[-1]} ({cols} of "
            f"{grid.total_steps}), {rows} of {grid.total_requests} requests, "
            f"{t_first:.2f}–{t_last:.2f} s after the first arrival")


def plot_timeline(grid: TimelineGrid, path: str, *, title: str | None = None,
                  x_axis: str = "time") -> TimelineGeometry:
    """Draw ``grid`` and its panels to a PNG at ``path``; return where the grid landed.

    ``x_axis``: ``time`` (seconds since the first arrival, steps as wide as they took) or
    ``step`` (one column per step).
    """
    if x_axis not in X_AXES:
        raise ValueError(f"x axis must be one of {', '.join(X_AXES)}, got {x_axis!r}")
    rows, ncols = grid.cells.shape
    cols = _time_columns(grid) if x_axis == "time" else _step_columns(grid)
    fontsize = 6 if rows > 30 else 8
    labels = grid.labels()
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)  # NOTE: Agg directly, never pyplot: no window, no global state
    axes = fig.subplots(
        5, 1, sharex=True,
        gridspec_kw={"height_ratios": [5, 1, 1, 1, 1], "hspace": 0.12,
                     "left": _left_margin(labels, fontsize), **_MARGIN},
    )
    width_px, height_px = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)
    box = axes[0].get_position()
    # NOTE: fixed margins (no tight/constrained layout), so the box is final before drawing.
    geom = TimelineGeometry(
        width_px, height_px,
        left=box.x0 * width_px, top=(1 - box.y1) * height_px,
        right=box.x1 * width_px, bottom=(1 - box.y0) * height_px,
        num_rows=rows, num_cols=ncols, x_min=cols.x_min, x_max=cols.x_max,
        col_edges=tuple((float(cols.edges[j]), float(cols.edges[j + 1]))
                        for j in cols.step_col),
    )
    _draw_grid(axes[0], grid, cols, geom, fontsize)
    marks = _ttft_marks(grid, cols, x_axis) if grid.infos else []
    if marks:
        _draw_ttft_marks(axes[0], marks, rows)
        geom = replace(geom, ttft_marks=tuple(marks))
    _draw_panels(axes[1:], cols, _panel_values(grid, cols))
    axes[-1].set_xlim(cols.x_min, cols.x_max)
    steps = grid.steps
    if x_axis == "step":
        axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
        axes[-1].xaxis.set_major_formatter(FuncFormatter(
            lambda v, _: str(steps[int(v)]) if 0 <= v < ncols and v == int(v) else ""))
        axes[-1].set_xlabel("step")
    else:
        axes[-1].xaxis.set_major_locator(MaxNLocator(nbins=20))
        axes[-1].set_xlabel("seconds since the first arrival")
    fig.suptitle(title or default_title(grid), fontsize=11, y=0.995)
    handles: list[Artist] = [Patch(facecolor=color, edgecolor="#888888", label=label)
                             for label, color in LEGEND.values()]
    if marks:
        handles.append(Line2D([], [], linestyle="none", marker="v", markersize=7,
                              markerfacecolor=MISSED_TTFT[1], markeredgecolor="black",
                              label=MISSED_TTFT[0]))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.54, 0.972), frameon=False)
    fig.savefig(path, dpi=DPI)
    return geom
