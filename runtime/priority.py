"""The lowest CPU priority for a thread whose work should take only idle cores."""

from __future__ import annotations

import os
import threading


def lowest_priority() -> None:
    """The calling thread (only it, on Linux) on SCHED_IDLE, which runs only where no other
    thread wants the core; where that is refused, at nice 19; elsewhere as it was."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
