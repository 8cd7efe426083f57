"""Every patch this project makes to third-party internals, in one place: `megatron_core.py` (fixes needed on any
device, and what Megatron-Core needs on CPU with gloo), `torch_distributed.py` (checkpoint loading that runs no code
from the files, TCPStore servers bound to their host) and `vllm_engine.py` (the CPU engines). Each patch names the
failure it fixes and the versions checked; each set is applied by one idempotent call (`apply_patches()` applies
the torch set too), and tests/unit/test_patches.py, test_torch_patches.py and test_vllm_patches.py test them.

Each patch imports what it patches when it is applied, not at the top: vLLM's processes load this package as a
plugin without Megatron (a GPU vLLM image may not have it), and trainer processes never import vLLM.
"""

from megatron_rl.parallel.patches.megatron_core import applied_patches, apply_patches
from megatron_rl.parallel.patches.torch_distributed import (
    UnsafeCheckpointError,
    applied_torch_patches,
    apply_torch_patches,
    read_metadata_safely,
)
from megatron_rl.parallel.patches.vllm_engine import (
    SMALL_LINEAR_ELEMENTS,
    VLLM_PATCHES_ENV,
    VLLM_WAIT_POLL_MAX_S,
    VLLM_WAIT_POLL_S,
    VLLM_WAIT_POLL_SHARE,
    applied_vllm_patches,
    apply_vllm_patches,
    async_llm_client,
    vllm_poll_pause,
)

__all__ = [
    "SMALL_LINEAR_ELEMENTS", "VLLM_PATCHES_ENV", "VLLM_WAIT_POLL_MAX_S", "VLLM_WAIT_POLL_S", "VLLM_WAIT_POLL_SHARE",
    "UnsafeCheckpointError",
    "applied_patches", "applied_torch_patches", "applied_vllm_patches", "apply_patches", "apply_torch_patches",
    "apply_vllm_patches", "async_llm_client", "read_metadata_safely", "vllm_poll_pause",
]  # fmt: skip
