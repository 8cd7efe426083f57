"""SCHED_BATCH for the compute processes of a CPU run: every thread of the process, threads started later too, and
only where the config asks for it. Each case runs in a subprocess (the policy would stay on the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")

PROBE = r"""
import json, os, sys, threading
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # a known start, whatever the test runner's policy
def policies():
    return sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
at_start = policies()
case = sys.argv[1]
if case == "direct":
    from megatron_rl.parallel.scheduling import use_batch_scheduling
    switched = use_batch_scheduling()
elif case.startswith("engine"):
    from megatron_rl.rollout.engine_mode import EngineSpec, prepare_engine_process
    spec = EngineSpec("engine-0", "unused", cpu_batch_scheduling=case != "engine-off")
    prepare_engine_process(spec, on_gpu=case == "engine-gpu")
    switched = None
else:  # the trainer's entry point, up to its loop
    from megatron_rl.config import RunConfig
    from megatron_rl.trainer import loop
    seen = {}
    loop.run_loop = lambda cfg, spec: seen.update(policies=policies())
    spec_path = sys.argv[2]
    config = RunConfig().model_dump(mode="json")
    config["trainer"]["cpu_batch_scheduling"] = case == "trainer"
    open(spec_path, "w").write(json.dumps({"config": config}))
    loop.main(spec_path)
    switched = None
after = threading.Thread(target=stop.wait)
after.start()
out = {"at_start": at_start, "policies": policies(), "switched": switched, "threads": threading.active_count()}
if case.startswith("trainer"):
    out["in_loop"] = seen["policies"]
stop.set()
print(json.dumps(out))
"""


def _probe(case: str, tmp_path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, case, str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_thread_runs_batch_policy_started_before_or_after(tmp_path):
    out = _probe("direct", tmp_path)
    assert out["at_start"] == [os.SCHED_OTHER], out
    assert out["policies"] == [os.SCHED_BATCH], out  # the thread started before, and the one started after
    assert out["switched"] >= 2 and out["threads"] == 3, out


def test_the_trainer_ranks_run_batch_policy_unless_the_config_says_no(tmp_path):
    assert _probe("trainer", tmp_path)["in_loop"] == [os.SCHED_BATCH]
    assert _probe("trainer-off", tmp_path)["in_loop"] == [os.SCHED_OTHER]


def test_a_cpu_engine_runs_batch_policy_unless_the_config_says_no_or_it_runs_on_a_gpu(tmp_path):
    assert _probe("engine", tmp_path)["policies"] == [os.SCHED_BATCH]
    assert _probe("engine-off", tmp_path)["policies"] == [os.SCHED_OTHER]
    assert _probe("engine-gpu", tmp_path)["policies"] == [os.SCHED_OTHER]


def test_a_refused_thread_keeps_its_policy_with_a_warning_and_the_others_are_switched(monkeypatch, caplog):
    from megatron_rl.parallel import scheduling

    calls = []

    def refuse_the_first(tid, policy, param):  # stands in for the kernel: no policy really changes
        calls.append(tid)
        if len(calls) == 1:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(scheduling.os, "sched_setscheduler", refuse_the_first)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)  # a second thread, so that one is left to switch after the refusal
    helper.start()
    try:
        with caplog.at_level("WARNING", logger=scheduling.__name__):
            switched = scheduling.use_batch_scheduling()
    finally:
        stop.set()
        helper.join()
    assert len(calls) >= 2 and switched == len(calls) - 1, calls
    assert f"thread {calls[0]} refused SCHED_BATCH" in caplog.text and "Operation not permitted" in caplog.text


def test_threads_started_while_the_listing_is_walked_are_switched_too(monkeypatch):
    from megatron_rl.parallel import scheduling

    listings = iter([["11"], ["11", "12"], ["11", "12", "13"]])  # two threads start during the walk
    last = ["11", "12", "13"]
    calls = []
    monkeypatch.setattr(scheduling.os, "listdir", lambda path: next(listings, last))
    monkeypatch.setattr(scheduling.os, "sched_setscheduler", lambda tid, policy, param: calls.append(tid))
    assert scheduling.use_batch_scheduling() == 3 and calls == [11, 12, 13]  # each once


def test_cores_a_process_cannot_use_are_refused_naming_the_field():
    from megatron_rl.parallel import scheduling

    before = os.sched_getaffinity(0)
    message = r"rollout.cpu_affinity=\[4096\]: this process cannot run there .* may use here: "
    with pytest.raises(ValueError, match=message):
        scheduling.place_process([4096], False, "rollout.cpu_affinity")
    assert os.sched_getaffinity(0) == before
