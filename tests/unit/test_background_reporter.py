"""The trainer's step reporter (metrics/background.py): reports run in order off the caller's thread, at most one
outstanding, and an error surfaces at the next call instead of vanishing."""

from __future__ import annotations

import threading

import pytest

from megatron_rl.metrics.background import BackgroundReporter


def test_reports_run_off_the_callers_thread_in_order():
    reporter = BackgroundReporter()
    done, threads = [], set()
    release = threading.Event()

    def report(i):
        threads.add(threading.get_ident())
        if i == 0:
            assert release.wait(10)  # the caller goes on while the first report is still running
        done.append(i)

    reporter.submit(lambda: report(0))
    assert done == []  # submit returned before the report finished
    release.set()
    for i in range(1, 5):
        reporter.submit(lambda i=i: report(i))
    reporter.close()
    assert done == [0, 1, 2, 3, 4]
    assert threads and threading.get_ident() not in threads


def test_a_failed_report_raises_at_the_next_submit_and_at_close():
    reporter = BackgroundReporter()
    reporter.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        reporter.submit(lambda: None)
    reporter.submit(lambda: (_ for _ in ()).throw(RuntimeError("metrics.jsonl: disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        reporter.close()
