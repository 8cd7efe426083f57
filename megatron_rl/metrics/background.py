"""Step reporting off the training path: rank 0's per-step bookkeeping (buffer and engine counters, metrics files)
on one background thread, in step order.

That bookkeeping is mostly waiting on Ray actors and writing files (about 15 ms a step on a 2-core machine, the
TensorBoard writer the largest part); the trainer's next step need not wait for it. At most one step's report is
outstanding: the next `submit` waits for the previous one and raises its error, so a failing logger stops the run
one step later than it would inline, never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundReporter:
    """Runs each submitted report on one background thread, in order; errors surface at the next call."""

    def __init__(self, name: str = "mrl-step-report"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Future | None = None

    def submit(self, report: Callable[[], None]) -> None:
        """Wait for the previous report (re-raising its error), then start `report` in the background."""
        self.wait()
        self._pending = self._pool.submit(report)

    def wait(self) -> None:
        """Wait for the outstanding report, if any; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the outstanding report (re-raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
