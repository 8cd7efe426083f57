"""Finding a test run's own processes (psutil): only below a given process, since other runs on the machine have
processes of the same names."""

from __future__ import annotations

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below `pid` ([] once it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def titled_below(pid: int, prefix: str) -> psutil.Process | None:
    """A process below `pid` whose command line starts with `prefix` (Ray titles actors `ray::Class...`), or None."""
    for proc in descendants(pid):
        try:
            if " ".join(proc.cmdline()).startswith(prefix):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None
