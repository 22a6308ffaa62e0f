"""Activation checkpointing of a compiled step, as users apply it before `torch.compile`.

torchtitan's `apply_ac` wraps each block in `torch.utils.checkpoint` (non-reentrant) and then
`apply_compile` compiles it: dynamo traces the checkpoint as a region, AOTAutograd tags its nodes
(recompute, or save where a selective policy says so) and torch's partitioner recomputes the
region in backward. The selective policies are the eager strategies' (`selective:<policy>` of
`remat.planning.solvers.selective`) written as torch's selective-checkpoint policies
(`create_selective_checkpoint_contexts`), which see one aten op at a time:

- `selective:torchtitan`: torchtitan's `_get_custom_policy` over its `_save_list`
  (`remat.device.cost.torchtitan_saves`, as the eager policy): save mm and attention outputs and
  the full `max` reductions (float8's amax), but recompute every second mm (counted in the
  forward, as torchtitan counts it). A float8 matmul counts as the `aten.mm` torchao's
  Float8Linear runs it as (the policy sees that, not the `_scaled_mm` below it), and `addmm` as
  an mm (a linear with a bias; torchtitan's models have none);
- `selective:save-matmuls`: save every matmul-class and attention output;
- `selective:megatron`: recompute the attention core, save the rest; op by op this is the
  fused attention op, so a model whose attention core is several ops (scores, softmax, product
  with V) is refused by name.

Attention on the CPU backend is `_scaled_dot_product_flash_attention_for_cpu`, the stand-in of
the GPU's flash attention that torchtitan's list saves. The other strategies choose by the graph
(`sqrt`, `first_k`, `chain_dp`, `milp`, `auto`, ...): their compiled form is remat's own
partitioner (`remat.compile`), not a wrapping, so they are refused with that advice.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.device.cost import (
    ATTENTION_PREFIXES,
    MATMUL_OPS,
    TORCHTITAN_MM_OPS,
    torchtitan_saves,
)
from remat.errors import RematError
from remat.graph import Graph

#: `ac` values a compiled step takes: no checkpointing, each block fully checkpointed, or each
#: block under a selective op policy.
AC_MODES = (
    None,
    "store_all",
    "full",
    "selective:torchtitan",
    "selective:save-matmuls",
    "selective:megatron",
)
_SOFTMAX = frozenset({"_softmax", "softmax", "_safe_softmax"})


def _short(target: str) -> str:
    """The packet name of an overload's name (`mm` of `aten.mm.default`)."""
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_attention(target: str) -> bool:
    return _short(target).startswith(ATTENTION_PREFIXES)


def _torchtitan(meta: dict[str, int], target: str) -> bool:
    meta["mm"] += target in TORCHTITAN_MM_OPS
    return torchtitan_saves(target, meta["mm"])


def _save_matmuls(meta: dict[str, int], target: str) -> bool:
    return _short(target) in MATMUL_OPS or _is_attention(target)


def _megatron(meta: dict[str, int], target: str) -> bool:
    return not _is_attention(target)


#: For each selective strategy, whether an op's output is saved (`meta`: the policy's counters;
#: the op by its overload's name, `aten.mm.default`).
_SAVES: dict[str, Callable[[dict[str, int], str], bool]] = {
    "selective:torchtitan": _torchtitan,
    "selective:save-matmuls": _save_matmuls,
    "selective:megatron": _megatron,
}


def _context_fn(saves: Callable[[dict[str, int], str], bool]) -> Any:
    """A fresh selective-checkpoint context per call of the region, its counters with it (as
    torchtitan's `selective_checkpointing_context_fn` makes one)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # the forward and an eager recompute count apart, so both take the same decisions
    meta: dict[bool, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        saved = saves(meta[ctx.is_recompute], str(func))
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    """A block under activation checkpointing, as torchtitan wraps it before compiling:
    `torch.utils.checkpoint` (non-reentrant) around its forward, with `ac`'s selective policy
    where it has one."""

    def __init__(self, block: nn.Module, ac: str):
        super().__init__()
        self.block = block
        saves = _SAVES.get(ac)
        self.context_fn = functools.partial(_context_fn, saves) if saves else None

    def __getattr__(self, name: str) -> Any:
        """What the block has, as torch's `CheckpointWrapper` forwards it: a model that asks its
        layers something (torchtune's `self.layers[0].caches_are_enabled()`) asks the block."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "block":
                raise
            return getattr(self.block, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        extra = {"context_fn": self.context_fn} if self.context_fn else {}
        return torch.utils.checkpoint.checkpoint(
            self.block, *args, use_reentrant=False, **extra, **kwargs
        )


def check_ac(ac: str | None, graph: Graph) -> str | None:
    """`ac` as a compiled step takes it (None for no checkpointing), or a RematError that names
    what to do instead: a strategy that chooses by the graph, a model without blocks, or Megatron's
    policy on an attention core of several ops."""
    if ac in (None, "store_all"):
        return None
    if ac not in AC_MODES:
        raise RematError(
            f"ac={ac!r} under torch.compile: choose one of "
            f"{', '.join(str(a) for a in AC_MODES[1:])}, which wrap each block before it is "
            "compiled as torchtitan does; remat's planned strategies (auto, milp, mincut) run "
            "under torch.compile as remat.compile(model, budget=..., strategy=...), whose plan "
            "predicts its own peak; others (sqrt, first_k, chain_dp) are predicted eager: "
            "leave out --compile"
        )
    if not graph.blocks:
        raise RematError(
            f"ac={ac!r} checkpoints each repeated block (numbered submodules such as layers.0); "
            "this model has none: leave out ac"
        )
    if ac == "selective:megatron":
        for b in graph.blocks:
            ops = graph.ops[b.first_op : b.last_op + 1]
            core = [op.short for op in ops if op.short in _SOFTMAX]
            if core:
                raise RematError(
                    f"ac='selective:megatron' recomputes the attention core; block {b.path} "
                    f"computes it in several ops ({core[0]} between its matmuls), which torch's "
                    "selective checkpointing sees one at a time: use fused attention "
                    "(scaled_dot_product_attention), or ac='selective:torchtitan' or 'full'"
                )
    return ac


def wrap_blocks(model: nn.Module, graph: Graph, ac: str) -> nn.Module:
    """`model` with each of `graph.blocks` replaced, in place, by its `Checkpointed` wrapper;
    the wrapper keeps the block's path (the block becomes its `block` child)."""
    for b in graph.blocks:
        parent, _, name = b.path.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        holder.register_module(name, Checkpointed(holder.get_submodule(name), ac))
    return model
