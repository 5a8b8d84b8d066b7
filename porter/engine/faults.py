"""Fault injection for the crash/resume tests (tests/test_faults.py runs conversions in subprocesses)."""

from __future__ import annotations

import os
import signal
import threading

_state: dict = {"kill": None, "log": None, "counts": {}}
_lock = threading.Lock()


def arm() -> None:
    """Test-only, read when a conversion starts: PORTER_FAULT="kill=EVENT:N,log=FILE" (either part alone)
    SIGKILLs the process at the N-th EVENT / appends every event as EVENT:N to FILE."""
    parts = (p.partition("=") for p in os.environ.get("PORTER_FAULT", "").split(",") if p)
    spec = {k: v for k, _, v in parts}
    with _lock:
        _state.update(kill=spec.get("kill"), log=spec.get("log"), counts={})


def fault_point(event: str) -> None:
    if not (_state["kill"] or _state["log"]):
        return
    with _lock:
        n = _state["counts"][event] = _state["counts"].get(event, 0) + 1
        if _state["log"]:
            with open(_state["log"], "a") as f:
                f.write(f"{event}:{n}\n")
        if _state["kill"] == f"{event}:{n}":
            os.kill(os.getpid(), signal.SIGKILL)
