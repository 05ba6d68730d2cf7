"""Pictures and exports of step traces: timelines, Chrome trace events, trace metrics.

``summary`` and ``chrome`` need only the standard library; ``timeline`` needs matplotlib.
"""

from kvloop.viz.chrome import chrome_trace, write_chrome_trace
from kvloop.viz.summary import (
    TraceRequest,
    load_records,
    reconstruct_requests,
    scheduler_totals,
    summarize_trace,
)

__all__ = [
    "TraceRequest",
    "chrome_trace",
    "load_records",
    "reconstruct_requests",
    "scheduler_totals",
    "summarize_trace",
    "write_chrome_trace",
]
