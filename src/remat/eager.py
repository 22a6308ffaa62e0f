"""Realise a `Plan` on a live `nn.Module` with PyTorch's own mechanisms.

Each region becomes `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around the module
(or run of consecutive blocks) it names; a region that keeps some ops gets a selective-checkpoint
policy (`create_selective_checkpoint_contexts`) that marks exactly those ops MUST_SAVE. Ops are
matched by their position in the region's traced op stream, so "keep `h.3.attn.c_attn.addmm_0`"
means that call, on every run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat.errors import RematError
from remat.plans import Plan

_ORIGINAL = "_remat_original_forward"


#: Ops a fake-tensor trace can record that a real run does not issue (FakeTensor detaches the
#: constants it makes, e.g. the result of `torch.full`); they allocate nothing.
_TRACE_ONLY = frozenset(
    {
        "aten.detach.default",
        "aten.alias.default",
        "aten.lift_fresh.default",
        "aten.lift_fresh_copy.default",
    }
)


def _policy_factory(targets: list[str], keep: list[bool]) -> Callable[[], Any]:
    """A `context_fn` for checkpoint: fresh selective-checkpoint contexts per call whose policy walks
    the region's traced op stream. Traced aliasing ops the real run does not issue are skipped; real
    ops the trace did not record (no tensor output) are recomputed without advancing."""

    def context_fn():
        position = [0]

        def policy(ctx, func, *args, **kwargs):
            name, pos = str(func), position[0]
            while pos < len(targets) and targets[pos] != name and targets[pos] in _TRACE_ONLY:
                pos += 1
            if pos < len(targets) and targets[pos] == name:
                position[0] = pos + 1
                if keep[pos]:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _batchnorms(modules: list[nn.Module]) -> list[nn.Module]:
    return [
        m
        for root in modules
        for m in root.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _restore_batchnorm_after_backward(norms: list[nn.Module], args: tuple) -> None:
    """Recomputation re-runs BatchNorm in training mode and updates its running statistics a
    second time. Snapshot them now, after the region's forward, and put them back once the
    region's backward (and so its recomputation) is done: when its input's gradient arrives.
    Nothing here may run inside recomputation, whose op stream must match the forward's."""
    anchor = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
    if anchor is None:
        return
    snapshot = [[b.detach().clone() for b in m.buffers()] for m in norms]

    def restore(grad):
        with torch.no_grad():
            for m, buffers in zip(norms, snapshot, strict=True):
                for b, old in zip(m.buffers(), buffers, strict=True):
                    b.copy_(old)
        return grad

    anchor.register_hook(restore)


def _checkpointed(
    run: Callable[..., Any], modules: list[nn.Module], context_fn
) -> Callable[..., Any]:
    norms = _batchnorms(modules)

    @functools.wraps(run)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)  # inference: nothing to save, no overhead
        kw = {"context_fn": context_fn} if context_fn is not None else {}
        out = checkpoint(run, *args, use_reentrant=False, **kw, **kwargs)
        if norms:
            _restore_batchnorm_after_backward(norms, args)
        return out

    return forward


def _segment_runner(blocks: list[nn.Module], originals: list[Callable]) -> Callable[..., Any]:
    """Run consecutive blocks as one function: x -> b0(x, *rest) -> b1(., *rest) -> ... The model
    must chain them that way (a transformer's `for block in blocks: x = block(x, ...)`)."""

    def run(x, *rest, **kwargs):
        for fwd in originals:
            x = fwd(x, *rest, **kwargs)
        return x

    return run


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Install `plan` on `model` in place (undo with `remove`): a plan made for, or read from JSON
    for, any model of the same architecture."""
    remove(model)
    named = dict(model.named_modules())
    for region in plan.regions:
        missing = [p for p in region.modules if p not in named]
        if missing:
            raise RematError(
                f"plan region {region.modules[0]!r}: the model has no submodule {missing[0]!r}; "
                "the plan was made for another architecture"
            )
        kept = set(region.keep_at)
        context_fn = (
            _policy_factory(list(region.targets), [i in kept for i in range(len(region.targets))])
            if region.keep
            else None
        )
        blocks = [named[p] for p in region.modules]
        originals = [b.forward for b in blocks]
        run = originals[0] if len(blocks) == 1 else _segment_runner(blocks, originals)
        setattr(blocks[0], _ORIGINAL, originals[0])
        blocks[0].forward = _checkpointed(run, blocks, context_fn)
        for block, original in zip(blocks[1:], originals[1:], strict=True):
            setattr(block, _ORIGINAL, original)
            block.forward = _pass_through
    return model


def _pass_through(x, *args, **kwargs):
    """The later blocks of a checkpointed segment: the segment's first block already ran them."""
    return x


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: every module gets its own forward back."""
    for m in model.modules():
        if hasattr(m, _ORIGINAL):
            m.forward = getattr(m, _ORIGINAL)
            delattr(m, _ORIGINAL)
            if "forward" in vars(m) and m.forward is type(m).forward.__get__(m):
                del m.forward
    return model


def auto(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | str = "50%",
    strategy: str = "auto",
    device: str = "cpu",
    optimizer: str | None = None,
    **kwargs: Any,
) -> Plan:
    """Trace one step of `model(*example_inputs, **kwargs)` on fake tensors, plan under `budget`
    and apply the plan in place: the one line to add to a training script. Returns the plan."""
    from remat.planner import plan
    from remat.trace import trace

    graph = trace(model, *example_inputs, **kwargs)
    chosen = plan(graph, budget=budget, strategy=strategy, device=device, optimizer=optimizer)
    apply(model, chosen)
    return chosen
