"""`use_fused_cpu_adam`: torch's AdamW inside a Megatron optimizer switched to its fused CPU kernel, the same
update as the per-tensor loop Megatron leaves it with (real torch optimizers; the Megatron wrappers are plain
objects with the `optimizer` / `chained_optimizers` attributes the function reads)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.trainer.optimizer import torch_optimizers, use_fused_cpu_adam  # noqa: E402


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((16, 8), (8,), (3, 5, 7))]


def _adamw(decayed, not_decayed, **kwargs) -> torch.optim.AdamW:
    groups = [{"params": decayed, "weight_decay": 0.01}, {"params": not_decayed, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2, betas=(0.9, 0.99), **kwargs)


def _train(opts: list[torch.optim.Optimizer], params, steps: int = 5) -> None:
    """`steps` updates of every optimizer in `opts` with the same seeded gradients for `params` each time."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        for opt in opts:
            opt.step()


def test_chained_cpu_adamw_switches_to_fused_and_updates_as_the_loop_does():
    loop_params, fused_params = _params(0), _params(0)
    loop = _adamw(loop_params[:2], loop_params[2:])
    dense, expert = _adamw(fused_params[:2], []), _adamw([], fused_params[2:])
    megatron = types.SimpleNamespace(
        chained_optimizers=[types.SimpleNamespace(optimizer=dense), types.SimpleNamespace(optimizer=expert)]
    )
    assert torch_optimizers(megatron) == [dense, expert]
    assert use_fused_cpu_adam(megatron) == 2
    assert all(group["fused"] for opt in (dense, expert) for group in opt.param_groups)
    assert not any(group["fused"] for group in loop.param_groups)
    _train([loop], loop_params)
    _train([dense, expert], fused_params)
    for want, have, start in zip(loop_params, fused_params, _params(0), strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)
        assert float((have - start).detach().abs().max()) > 1e-2  # five steps at lr 1e-2 moved every tensor


def test_what_torch_refuses_to_fuse_is_left_alone():
    foreach = _adamw(_params(1), [], foreach=True)
    sgd = torch.optim.SGD(_params(2), lr=0.1)
    megatron = types.SimpleNamespace(
        chained_optimizers=[types.SimpleNamespace(optimizer=foreach), types.SimpleNamespace(optimizer=sgd)]
    )
    assert use_fused_cpu_adam(megatron) == 0
    assert not any(group.get("fused") for group in foreach.param_groups)
    assert "fused" not in sgd.defaults or not sgd.defaults["fused"]
