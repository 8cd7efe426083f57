"""Running several test or verification cases in one torchrun launch (one start-up for many layouts)."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path


def run_cases(spec_path: str, run_case: Callable[[dict], None]) -> None:
    """Run every case of a worker spec file in order; model-parallel groups are rebuilt between cases while the
    default process group stays."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel.groups import destroy_distributed

    spec = json.loads(Path(spec_path).read_text())
    for case in spec["cases"]:
        run_case(case)
        gc.collect()  # the case's model and optimizer go before the next one is built
        ps.destroy_model_parallel()
    destroy_distributed()
