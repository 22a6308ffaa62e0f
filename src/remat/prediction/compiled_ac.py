"""Activation checkpointing of a compiled step, as users apply it before `torch.compile`.

torchtitan's `apply_ac` wraps each block in `torch.utils.checkpoint` (non-reentrant) and then
`apply_compile` compiles it: dynamo traces the checkpoint as a region, AOTAutograd tags its nodes
(recompute, or save where a selective policy says so) and torch's partitioner recomputes the
region in backward. The selective policies are the eager strategies' (`selective:<policy>` of
`remat.planning.solvers.selective`) written as torch's selective-checkpoint policies
(`create_selective_checkpoint_contexts`), which see one aten op at a time:

- `selective:torchtitan`: torchtitan's `_get_custom_policy`: save mm and attention outputs, but
  recompute every second mm (counted in the forward, as torchtitan counts it). The eager policy
  counts `addmm` as an mm (a linear with a bias), and so does this one: on torchtitan's models,
  which have no biases, the two are torchtitan's list exactly;
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

from remat.device.cost import ATTENTION_PREFIXES, MATMUL_OPS
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
_MM = frozenset({"mm", "addmm"})
_SOFTMAX = frozenset({"_softmax", "softmax", "_safe_softmax"})


def _short(func: Any) -> str:
    return func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)


def _is_attention(short: str) -> bool:
    return short.startswith(ATTENTION_PREFIXES)


def _torchtitan(meta: dict[str, int], short: str) -> bool:
    if short in _MM:
        meta["mm"] += 1
        return meta["mm"] % 2 == 1
    return _is_attention(short)


def _save_matmuls(meta: dict[str, int], short: str) -> bool:
    return short in MATMUL_OPS or _is_attention(short)


def _megatron(meta: dict[str, int], short: str) -> bool:
    return not _is_attention(short)


#: For each selective strategy, whether an op's output is saved (`meta`: the policy's counters).
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
        saved = saves(meta[ctx.is_recompute], _short(func))
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
