"""torch.profiler for the benchmarks, without kineto's start / stop lines on stderr.

    profile(activities, **kw)   a context manager yielding a started torch.profiler.profile

torch's C++ profiler writes a line to file descriptor 2 as it starts and as it stops ("USDT: ...
profiler_start", "... profiler_stop"), which reaches every benchmark's log and every executed notebook's
output. `profile` holds fd 2 on /dev/null only while the profiler starts and while it stops; what the
profiled code writes in between, and any error, shows as usual.
"""
from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def _quiet_fd2():
    """File descriptor 2 on /dev/null inside the block (Python's sys.stderr flushed before and after)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real fd (a captured stream): nothing to hold
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, fd)
    finally:
        os.close(saved)


@contextlib.contextmanager
def profile(activities, **kw):
    """torch.profiler.profile(activities=activities, **kw), started and stopped with fd 2 held quiet."""
    from torch.profiler import profile as _profile
    prof = _profile(activities=activities, **kw)
    with _quiet_fd2():
        prof.start()
    try:
        yield prof
    finally:
        with _quiet_fd2():
            prof.stop()
