"""Fault injection for the crash/resume tests (tests/test_faults.py runs conversions in subprocesses)."""

from __future__ import annotations

import os
import signal
import threading
import time

_state: dict = {"kill": None, "stall": None, "log": None, "counts": {}}
_lock = threading.Lock()
STALL_SECONDS = 3.0


def arm() -> None:
    """Test-only, read when a conversion starts: PORTER_FAULT="kill=EVENT:N,stall=EVENT:N,log=FILE" (any
    part alone) SIGKILLs the process at the N-th EVENT / holds the thread that reaches it for STALL_SECONDS
    (a window to signal a run in the middle of its work) / appends every event as EVENT:N to FILE."""
    parts = (p.partition("=") for p in os.environ.get("PORTER_FAULT", "").split(",") if p)
    spec = {k: v for k, _, v in parts}
    with _lock:
        _state.update(kill=spec.get("kill"), stall=spec.get("stall"), log=spec.get("log"), counts={})


def fault_point(event: str) -> None:
    if not (_state["kill"] or _state["stall"] or _state["log"]):
        return
    with _lock:
        n = _state["counts"][event] = _state["counts"].get(event, 0) + 1
        if _state["log"]:
            with open(_state["log"], "a") as f:
                f.write(f"{event}:{n}\n")
        if _state["kill"] == f"{event}:{n}":
            os.kill(os.getpid(), signal.SIGKILL)
    if _state["stall"] == f"{event}:{n}":
        time.sleep(STALL_SECONDS)
