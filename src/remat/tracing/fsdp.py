"""A model sharded by FSDP2 (`fully_shard`) traced as the bare model it shards: the tracer's view of
FSDP, which a fake trace must hold off (its hooks would leave fake tensors in FSDP's buffers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat.errors import RematError


def is_fsdp_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) wrapped `model` or one of its modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def fsdp_sharded_as_bare(model: nn.Module) -> Iterator[None]:
    """An FSDP2-sharded `model` (`fully_shard`) seen as the bare model it shards, for the length
    of a fake trace (`remat.trace` does this by itself): each sharded parameter (a DTensor)
    replaced by a meta tensor of its full shape (tied ones stay tied), and FSDP's forward hooks,
    which would gather parameters (leaving fake tensors in FSDP's buffers, so that the next real
    step returns a fake loss) and register the backward's, held off; both are put back as they
    were. A plan is the bare step's: activations per rank, parameters and gradients whole."""
    from torch.distributed.tensor import DTensor

    stand_in: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    held: list[tuple[dict, dict]] = []
    try:
        for module in model.modules():
            for name, p in module._parameters.items():
                if isinstance(p, DTensor):
                    if p.device_mesh.ndim != 1:
                        raise RematError(
                            f"parameter {name!r} of {type(module).__name__} is sharded over a "
                            f"{p.device_mesh.ndim}-D mesh (FSDP with tensor parallelism): plan "
                            "before sharding (remat.layouts.parallel) and apply the plan before FSDP"
                        )
                    if id(p) not in stand_in:
                        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                        stand_in[id(p)] = nn.Parameter(meta, requires_grad=p.requires_grad)
                    swapped.append((module, name, p))
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                before = dict(hooks)
                fsdp = {k for k, h in before.items() if _is_fsdp_hook(h)}
                if fsdp:
                    held.append((hooks, before))
                    for k in fsdp:
                        del hooks[k]
        for module, name, p in swapped:
            module._parameters[name] = stand_in[id(p)]
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
        for hooks, before in held:
            added = {k: h for k, h in hooks.items() if k not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


def _is_fsdp_hook(hook: Any) -> bool:
    return getattr(hook, "__module__", "").startswith("torch.distributed.fsdp.")
