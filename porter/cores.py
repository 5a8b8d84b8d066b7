"""The CPU cores this process may run on (a leaf module: the engine, verify and the digests all size their
thread pools from it)."""

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
