"""Benchmark: what scoring math-verify's reward in reward processes costs against reward threads.

    .venv/bin/python bench/reward_isolation.py [--groups 8] [--samples 8] [--rounds 10]

Scores rounds of `--groups` groups of `--samples` responses (LaTeX and plain answers, half of them right) with the
built-in `math` reward through `RewardRunner`, as the generation driver does (a group's calls at once, the groups
one after another), alternating a runner on threads (`task.reward_isolation: thread`) and one on processes
(`process`, what `auto` picks for `math`), both started beforehand and warmed up by one round. Timed per round:
wall seconds, and CPU seconds of this process and every process under it (from /proc).

Printed (one JSON object): per mode `wall_ms_per_call` and `cpu_ms_per_call` (medians over rounds; /proc counts
CPU in 10 ms ticks, so give rounds of a few hundred milliseconds), and `process_over_thread` for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _proc import tree_cpu_s  # beside this file

from megatron_rl.rollout.rewards import RewardRunner, RewardSet, describe, math_reward

RESPONSES = [
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("So x = 3.", "4"),
    ("We get $\\sqrt{2}$", "\\sqrt 2"),
    ("Total: 42 apples", "41"),
    ("$$(1, 2)$$", "(1,2)"),
    ("It is \\boxed{10\\%}", "12\\%"),
    ("Hence \\boxed{2\\pi}", "2\\pi"),
    ("#### 7", "8"),
]
"""(response, reference) pairs; half of them right."""


async def _round(runner: RewardRunner, groups: int, samples: int) -> tuple[float, float]:
    rewards = RewardSet([describe(math_reward, "math", source="math")])
    wall, cpu = time.perf_counter(), tree_cpu_s()
    for g in range(groups):
        response, answer = RESPONSES[g % len(RESPONSES)]
        records = [{"answer": answer, "source": f"bench:{g}"}] * samples
        scored = await rewards.score([response] * samples, records, [None] * samples, runner)
        assert all(s.error is None for s in scored), scored[0].error
    return time.perf_counter() - wall, tree_cpu_s() - cpu


def main() -> None:
    """Run the comparison and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    runners = {mode: RewardRunner(60.0, workers=2, isolation=mode) for mode in ("thread", "process")}
    spec = describe(math_reward, "math", source="math")
    for runner in runners.values():
        runner.start([spec])
    calls = args.groups * args.samples
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in runners}
    for i in range(args.rounds + 1):
        for mode, runner in runners.items():
            wall, cpu = asyncio.run(_round(runner, args.groups, args.samples))
            if i:  # the first round warms both up
                times[mode].append((wall, cpu))
    for runner in runners.values():
        runner.shutdown()
    out: dict = {"calls_per_round": calls, "rounds": args.rounds}
    for mode, rounds in times.items():
        out[mode] = {
            "wall_ms_per_call": round(1000 * statistics.median(w for w, _ in rounds) / calls, 3),
            "cpu_ms_per_call": round(1000 * statistics.median(c for _, c in rounds) / calls, 3),
        }
    out["process_over_thread"] = {  # None where the threads' figure is below /proc's 10 ms ticks
        key: round(out["process"][key] / out["thread"][key], 3) if out["thread"][key] else None
        for key in ("wall_ms_per_call", "cpu_ms_per_call")
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
