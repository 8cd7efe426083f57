"""What the benchmarks that read CPU time from /proc share: a process's CPU seconds, the processes under one, and
their sum (Linux only)."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second, the unit of /proc's CPU times."""


def proc_stat(path: str) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds) from a /proc stat file; None once the process or thread is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def descendants(root: int) -> dict[int, str]:
    """Every live process under `root` (and `root` itself), with its command line."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(f"/proc/{entry}/stat")) is not None:
            parents[int(entry)] = stat[1]
    found, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in found]
        found.update(children)
        frontier = children
    out = {}
    for pid in found:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds used so far by process `root` (default: this one) and every live process under it."""
    pids = descendants(os.getpid() if root is None else root)
    return sum(stat[2] for pid in pids if (stat := proc_stat(f"/proc/{pid}/stat")) is not None)
