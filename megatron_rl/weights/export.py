"""The policy out as a Hugging Face checkpoint folder (safetensors shards, index, config, tokenizer) that
transformers and vLLM load: every owner rank writes its own shards in parallel from the gathered full tensors,
rank 0 numbers them, writes the index and copies the config and tokenizer. Used by `convert mcore-to-hf`,
`megatron-rl export` and the end of a training run; a collective (every rank of the model's job calls it).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.models import ModelArch, ModelFamily
from megatron_rl.models.hf_checkpoint import HFCheckpoint, ShardedWriter, copy_side_files, staging_folder, write_index
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.weights.gather import iter_hf_tensors


def write_hf_checkpoint(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    out: str | Path,
    hf_side: str | Path,
    dtypes: dict[str, str] | None = None,
) -> int:
    """(Every rank) write the model as a HF checkpoint into `out` (an existing, empty folder; the caller stages
    and renames it); `hf_side` is a folder with the config and tokenizer files to copy; `dtypes` (HF name ->
    dtype name) restores each tensor's checkpoint dtype (default: the model's). A LoRA model is written merged
    (`W0 + alpha/r B A` in every adapted weight). Returns the bytes written."""
    out = Path(out)
    dtypes = dtypes or {}
    writer = ShardedWriter(out, prefix=f"rank{ctx.rank:05d}")
    for experts in (False, True):
        for name, tensor in iter_hf_tensors(model, family, arch, ctx, experts=experts, merge_lora=True):
            target = getattr(torch, dtypes.get(name, str(tensor.dtype).removeprefix("torch.")))
            writer.add(name, tensor.to(target))
    shards, nbytes = writer.finish()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (shards, nbytes))
    total = sum(n for _, n in gathered)
    if ctx.rank == 0:
        write_index(out, [s for shards_of_rank, _ in gathered for s in shards_of_rank], total)
        copy_side_files(hf_side, out)
    dist.barrier()
    return total


def hf_dtypes(ckpt: HFCheckpoint) -> dict[str, str]:
    """Tensor name -> dtype name of a HF checkpoint, read from its safetensors headers (no tensor data loaded)."""
    return {name: ckpt.dtype_of(name) for name in ckpt.names()}


def export_hf_folder(model, family: ModelFamily, arch: ModelArch, ctx: ParallelContext, out: str | Path,
                     hf_dir: str | Path) -> int:  # fmt: skip
    """(Every rank) the model as a HF checkpoint folder `out`, replacing any earlier one there: written into a
    staging sibling and renamed into place only once every rank's shards, the index and the side files (those of
    the HF checkpoint `hf_dir`, whose dtypes the tensors take) are in. Returns the bytes written."""
    holder: list = [None]
    with contextlib.ExitStack() as stack:
        if ctx.rank == 0:
            holder[0] = str(stack.enter_context(staging_folder(out, overwrite=True, protect=[hf_dir])))
        dist.broadcast_object_list(holder, src=0)
        nbytes = write_hf_checkpoint(model, family, arch, ctx, holder[0], hf_dir, hf_dtypes(HFCheckpoint(hf_dir)))
    dist.barrier()  # rank 0 renamed it: `out` is whole on every rank's return
    return nbytes
