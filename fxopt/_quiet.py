"""Silence output that native libraries write straight to a file descriptor."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def silenced(fd: int):
    """Send what is written to file descriptor `fd` (1 stdout, 2 stderr) to /dev/null meanwhile."""
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        stream.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
