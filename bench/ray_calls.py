"""Benchmark: what an actor call costs in CPU on this machine, the way the generation driver makes them.

    .venv/bin/python bench/ray_calls.py [--rounds 200]

Starts a local Ray (loopback, 2 CPUs) and an async actor that answers a list of requests at once, then times
`--rounds` rounds (after 30 warm-up rounds) of three ways of sending one driver burst of 8 groups of 8 requests
(`GenerationRequest`, the quickstart's: 12 prompt tokens, 8 new): `one_call_per_group` (8 concurrent calls, as
the driver made them until 2026-12-06), `one_call_per_burst` (one call with the 8 groups: `rollout/burst.py`),
and `one_call_per_group_sequential` (8 calls one after the other). CPU is the CPU seconds of this process and
every process under it (Ray's own processes and the actor), read from /proc; the machine should be idle.
Printed (one JSON object): per round and way, `cpu_ms` and `wall_ms`, and `burst_over_group_cpu`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

import ray  # noqa: E402
from _proc import tree_cpu_s  # noqa: E402  (beside this file)

from megatron_rl.rollout.ray_utils import start_local_ray  # noqa: E402
from megatron_rl.rollout.types import GenerationRequest  # noqa: E402

GROUPS, SAMPLES, WARMUP = 8, 8, 30


@ray.remote
class Answerer:
    """Answers every request of every group with its prompt length (the call's cost is what is measured)."""

    async def groups(self, groups: list[list[GenerationRequest]]) -> list[list[int]]:
        return [[len(r.prompt_ids) for r in reqs] for reqs in groups]


def main() -> None:
    """Time each way of sending a burst and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    start_local_ray(num_cpus=2, log_to_driver=False)
    actor = Answerer.remote()
    burst = [
        [GenerationRequest(prompt_ids=list(range(12)), max_tokens=8, seed=g * SAMPLES + s) for s in range(SAMPLES)]
        for g in range(GROUPS)
    ]

    async def per_group() -> None:
        await asyncio.gather(*(actor.groups.remote([reqs]) for reqs in burst))

    async def per_burst() -> None:
        await actor.groups.remote(burst)

    async def sequential() -> None:
        for reqs in burst:
            await actor.groups.remote([reqs])

    ways = {"one_call_per_group": per_group, "one_call_per_burst": per_burst,
            "one_call_per_group_sequential": sequential}  # fmt: skip

    async def rounds(way, n: int) -> None:
        for _ in range(n):
            await way()

    out: dict = {"rounds": args.rounds, "groups": GROUPS, "samples": SAMPLES}
    for name, way in ways.items():
        asyncio.run(rounds(way, WARMUP))
        cpu, wall = tree_cpu_s(), time.perf_counter()
        asyncio.run(rounds(way, args.rounds))
        out[name] = {"cpu_ms": round(1e3 * (tree_cpu_s() - cpu) / args.rounds, 3),
                     "wall_ms": round(1e3 * (time.perf_counter() - wall) / args.rounds, 3)}  # fmt: skip
    out["burst_over_group_cpu"] = round(out["one_call_per_burst"]["cpu_ms"] / out["one_call_per_group"]["cpu_ms"], 3)
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
