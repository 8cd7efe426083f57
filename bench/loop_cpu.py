"""Benchmark: where a step's CPU goes in the quickstart's loop, per process and per trainer thread.

    .venv/bin/python bench/loop_cpu.py [--steps 300] [--from-step 60] [--window-s 20] [--override k=v ...]
        [--size tiny|wide]

Runs `bench/peer_trl.py`'s megatron-rl side (configs/quickstart.yaml on its random 4-layer Qwen3-MoE of seed 0)
and, once step `--from-step` is logged, reads the CPU time of every process of the run (this one, its torchrun
ranks, Ray's processes and actors: all descendants of this process) from /proc at the start and the end of a
`--window-s` window, counting the steps logged in it. On a small machine every process competes for the same
cores, so a step's CPU seconds, not its wall time, say where it goes; they also vary less than tokens/s.

Printed (one JSON object on stdout; progress on stderr): `steps` in the window and `steps_per_s`;
`cpu_ms_per_step` by role: `trainer_ranks`, `engine` (the vLLM engine actors), `driver` (this process: the
launcher and the generation driver), `buffer`, `run_control`, `torchrun_agent` (torchrun's agent over the
ranks), `other` (Ray's own processes);
`trainer_threads_ms_per_step` (the ranks' main threads, gloo's transport and work threads, the rest);
`total_ms_per_step` and `cores_busy` (the share of the machine's cores the run kept busy in the window);
`context_switches_per_step` by role (voluntary and not, over every thread) and `threads` per role at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from _proc import descendants, proc_stat  # beside this file
from peer_trl import MODEL_NAMES, SIZES, make_model, run_mrl, say  # beside this file; it keeps a local Ray on loopback

from megatron_rl.metrics.logger import is_step_record, read_metrics

ROLES = (
    ("megatron_rl.parallel.torchrun", "torchrun_agent"),  # its command line names the ranks' module too
    ("megatron_rl.trainer.loop", "trainer_ranks"),
    ("ray::VLLMEngine", "engine"),
    ("ray::RolloutBuffer", "buffer"),
    ("ray::RunControl", "run_control"),
)
"""(Text its command line holds or starts with, role) of each process the run starts; anything else is `other`."""
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
"""Thread names of gloo's transport loops and of its process groups' work threads."""
SWITCH_KEYS = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")
"""The lines of a thread's /proc status that count its context switches."""


def role_of(pid: int, cmdline: str, me: int) -> str:
    """The role of process `pid` from its command line (`me`: this process, the driver)."""
    if pid == me:
        return "driver"
    return next((role for text, role in ROLES if text in cmdline), "other")


def thread_kind(pid: int, tid: int, name: str) -> str:
    """`main`, `gloo` or `other` for thread `tid` (named `name`) of process `pid`."""
    if tid == pid:
        return "main"
    return "gloo" if name.startswith(GLOO_THREADS) else "other"


def _switches(pid: int) -> tuple[int, int]:
    """(context switches so far, summed over the threads of process `pid`; its live threads)."""
    total, threads = 0, 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    for tid in tids:
        try:
            lines = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue
        threads += 1
        total += sum(int(line.split()[1]) for line in lines if line.startswith(SWITCH_KEYS))
    return total, threads


def snapshot(me: int) -> dict:
    """CPU seconds per role and per trainer thread kind, and context switches and threads per role, of the
    processes under `me` now."""
    roles: dict[str, float] = {}
    threads: dict[str, float] = {}
    switches: dict[str, int] = {}
    counts: dict[str, int] = {}
    for pid, cmdline in descendants(me).items():
        role = role_of(pid, cmdline, me)
        done, alive = _switches(pid)
        switches[role], counts[role] = switches.get(role, 0) + done, counts.get(role, 0) + alive
        if role != "trainer_ranks":
            stat = proc_stat(f"/proc/{pid}/stat")
            roles[role] = roles.get(role, 0.0) + (stat[2] if stat else 0.0)
            continue
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = proc_stat(f"/proc/{pid}/task/{tid}/stat")
            if stat is not None:
                kind = thread_kind(pid, int(tid), stat[0])
                threads[kind] = threads.get(kind, 0.0) + stat[2]
                roles[role] = roles.get(role, 0.0) + stat[2]
    return {"roles": roles, "threads": threads, "switches": switches, "thread_counts": counts}


def per_step(before: dict, after: dict, steps: int) -> dict[str, float]:
    """Milliseconds per step of each key, from two snapshots' CPU seconds (a process that ended counts 0)."""
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    return {k: round(1000 * spent[k] / steps, 1) for k in sorted(spent, key=spent.get, reverse=True)}


def logged_steps(metrics: Path) -> int:
    """The last step logged in a run's metrics.jsonl so far (0 before it exists)."""
    try:
        return max((r["step"] for r in read_metrics(metrics) if is_step_record(r)), default=0)
    except OSError:
        return 0


class Window(threading.Thread):
    """Waits for step `start` in `metrics`, then takes a snapshot at the start and the end of `seconds`."""

    def __init__(self, metrics: Path, start: int, seconds: float):
        super().__init__(daemon=True)
        self.metrics, self.start_step, self.seconds = metrics, start, seconds
        self.result: dict | None = None

    def run(self) -> None:
        """Sample the window (sets `result`)."""
        me = os.getpid()
        while logged_steps(self.metrics) < self.start_step:
            time.sleep(0.25)
        t0, s0, a = time.monotonic(), logged_steps(self.metrics), snapshot(me)
        time.sleep(self.seconds)
        t1, s1, b = time.monotonic(), logged_steps(self.metrics), snapshot(me)
        self.result = {"seconds": t1 - t0, "steps": s1 - s0, "before": a, "after": b, "ended_at": s1}


def summary(window: dict, cores: int) -> dict:
    """The printed figures from a window's snapshots."""
    steps, a, b = window["steps"], window["before"], window["after"]
    roles = per_step(a["roles"], b["roles"], steps)
    total = sum(b["roles"].values()) - sum(a["roles"].values())
    return {
        "steps": steps,
        "window_s": round(window["seconds"], 2),
        "steps_per_s": round(steps / window["seconds"], 3),
        "cpu_ms_per_step": roles,
        "trainer_threads_ms_per_step": per_step(a["threads"], b["threads"], steps),
        "total_ms_per_step": round(1000 * total / steps, 1),
        "context_switches_per_step": {
            role: round((n - a["switches"].get(role, 0)) / steps) for role, n in sorted(b["switches"].items())
        },
        "threads": dict(sorted(b["thread_counts"].items())),
        "cores_busy": round(total / (window["seconds"] * cores), 3),
    }


def main() -> None:
    """Run the quickstart's loop, sample one window and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of the run (the window must end before)")
    parser.add_argument("--from-step", type=int, default=60, help="the window starts once this step is logged")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--override", action="append", default=[], help="a config override k=v for the run")
    parser.add_argument("--work-dir", default="", help="keep the run here (default: a temporary folder)")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny", help="the model, as bench/peer_trl.py's")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loop_cpu_") as tmp:
        root = Path(args.work_dir or tmp)
        model = make_model(root, 0, args.size)
        window = Window(root / "mrl-seed0" / "metrics.jsonl", args.from_step, args.window_s)
        window.start()
        run_mrl(model, 0, args.steps, root, args.override)
        window.join(timeout=1.0)
    result = window.result
    if result is None or result["steps"] < 1 or result["ended_at"] >= args.steps:
        raise SystemExit(f"the window did not fit in the run's {args.steps} steps: raise --steps")
    out = summary(result, os.cpu_count() or 1)
    say(f"{out['steps']} steps in {out['window_s']} s: {out['total_ms_per_step']} CPU-ms a step")
    print(json.dumps({"model": MODEL_NAMES[args.size], "overrides": args.override} | out), flush=True)


if __name__ == "__main__":
    main()
