"""Background work at the lowest CPU priority, so that it never slows a model step."""

from __future__ import annotations

import os
import sys
import threading


def lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19).

    NOTE: Linux only: there a thread's nice value is its own, elsewhere it would be the
    whole process's."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
