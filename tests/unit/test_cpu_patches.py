"""The Megatron-Core CPU patches: applied by one call, idempotent, each doing what its docstring says.

Runs in a subprocess so that the patched torch.cuda does not leak into other tests. The parity tests in
tests/dist exercise every patch end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHECK = r"""
import json, torch
from megatron_rl.parallel.cpu_patches import apply_cpu_patches
names = apply_cpu_patches()
again = apply_cpu_patches()
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import utils as tutils, torch_norm, multi_latent_attention
from megatron.core.transformer.moe import moe_utils
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.dot_product_attention import DotProductAttention
import inspect
out = {
    "names": names,
    "idempotent": names == again,
    "current_device": str(torch.cuda.current_device()),
    "schedule_zeros": str(schedules.torch.zeros([], device="cuda").device),
    "causal_mask": str(tutils.get_default_causal_mask(4).device),
    "te_gemm_defined": hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None,
    "mla_have_te": multi_latent_attention.HAVE_TE,
    "dpa_takes_channels": "k_channels" in inspect.signature(DotProductAttention.__init__, follow_wrapped=False).parameters,
    "stream_noop": torch.cuda.current_stream() == torch.cuda.Stream(),
    "tensor_cuda": str(torch.ones(2).cuda().device),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def patched():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_all_patches_applied_once(patched):
    assert set(patched["names"]) == {
        "torch_cuda_shims",
        "rng_tracker",
        "literal_cuda_devices",
        "param_type_names",
        "torch_norm_sequence_parallel",
        "all_to_all_split_lists",
        "moe_utils_te_names",
        "local_attention_mla_channels",
        "mla_have_te_flag",
    }
    assert patched["idempotent"]


def test_cuda_devices_become_cpu(patched):
    assert patched["current_device"] == "cpu"
    assert patched["schedule_zeros"] == "cpu"
    assert patched["causal_mask"] == "cpu"
    assert patched["stream_noop"]
    assert patched["tensor_cuda"] == "cpu"


def test_te_fallbacks(patched):
    assert patched["te_gemm_defined"]
    assert patched["mla_have_te"] is False
    assert patched["dpa_takes_channels"]


def test_split_sizes_become_lists():
    code = r"""
import torch
from megatron_rl.parallel.cpu_patches import apply_cpu_patches
apply_cpu_patches()
from megatron.core.tensor_parallel import mappings
seen = {}
def fake_all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
    seen['types'] = (type(output_split_sizes).__name__, type(input_split_sizes).__name__)
    out.copy_(inp)
torch.distributed.all_to_all_single = fake_all_to_all_single
class G:
    def size(self): return 2
mappings._AllToAll.apply(G(), torch.ones(3, 2), torch.tensor([1, 2]), torch.tensor([2, 1]))
print(seen['types'])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "('list', 'list')"
