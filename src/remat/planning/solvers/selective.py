"""Selective-checkpointing policies: inside each checkpointed block, which ops' outputs to keep.

A policy is a plain function `(graph, block_ops) -> set of op names to keep`, in the spirit of JAX's
`dots_saveable`; everything not kept is recomputed in backward. Policies only ever keep outputs
that autograd would save anyway, except the matmul-saving ones, which keep what their namesakes
keep (torchtitan marks every mm output MUST_SAVE, needed or not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remat.device.cost import TORCHTITAN_MM_OPS, is_matmul, torchtitan_saves
from remat.graph import Graph, Op

Policy = Callable[[Graph, list[Op]], set[str]]

_SOFTMAX = frozenset({"_softmax", "softmax", "_safe_softmax", "_log_softmax"})


def _saved_outputs(graph: Graph, ops: list[Op]) -> set[str]:
    """Ops of the block whose output storage autograd saves (the only ones worth keeping)."""
    saved = set(graph.saved_storages)
    return {
        op.name
        for op in ops
        if any(
            graph.tensors[t].storage in saved
            and graph.storages[graph.tensors[t].storage].allocated_at == op.index
            for t in op.outputs
        )
    }


def attention_core(graph: Graph, ops: list[Op]) -> set[str]:
    """The attention core of a block (QK^T, scaling, masking, softmax, its dropout, the product with
    V), found from each softmax back to the matmul that made the scores and forward to the matmul
    that consumes the probabilities; a fused SDPA op is a core by itself."""
    in_block = {op.index for op in ops}
    producer = {t: graph.tensors[t].producer for op in ops for t in op.inputs}
    consumers: dict[int, list[Op]] = {}
    for op in ops:
        for t in op.inputs:
            consumers.setdefault(t, []).append(op)
    core: set[str] = {op.name for op in ops if op.short.startswith("_scaled_dot_product")}
    for op in ops:
        if op.short not in _SOFTMAX:
            continue
        core.add(op.name)
        stack = list(op.inputs)
        while stack:  # back to the score matmul
            p = producer.get(stack.pop())
            if p is None or p not in in_block or graph.ops[p].name in core:
                continue
            core.add(graph.ops[p].name)
            if not is_matmul(graph.ops[p]):
                stack.extend(graph.ops[p].inputs)
        frontier = list(op.outputs)
        while frontier:  # forward to the product with V
            for c in consumers.get(frontier.pop(), []):
                if c.name in core:
                    continue
                core.add(c.name)
                if not is_matmul(c):
                    frontier.extend(c.outputs)
    return core


def megatron(graph: Graph, ops: list[Op]) -> set[str]:
    """Korthikanti et al.: recompute the attention core, keep everything else autograd saves."""
    return _saved_outputs(graph, ops) - attention_core(graph, ops)


def save_matmuls(graph: Graph, ops: list[Op]) -> set[str]:
    """Keep the outputs of matmul-class ops (mm, bmm, conv, SDPA); recompute the cheap rest."""
    return {op.name for op in ops if is_matmul(op)}


def torchtitan(graph: Graph, ops: list[Op]) -> set[str]:
    """torchtitan's op-level policy (`remat.device.cost.torchtitan_saves`): keep mm and SDPA
    outputs and the float8 casts' amax, but recompute every second mm."""
    keep, mm_count = set(), 0
    for op in ops:
        mm_count += op.target in TORCHTITAN_MM_OPS
        if torchtitan_saves(op.target, mm_count):
            keep.add(op.name)
    return keep


POLICIES: dict[str, Policy] = {
    "megatron": megatron,
    "save-matmuls": save_matmuls,
    "torchtitan": torchtitan,
}

#: The policies that stand for a peer's own op list, kept whole as torch's selective
#: checkpointing runs it: its cache holds a MUST_SAVE output until the region's backward even
#: where the replay stops before reading it (a Llama block's last mm under torchtitan: 4.0 GiB
#: of the published P2 run, docs/accuracy.md). The others keep only what their replay reads.
AS_PEERS_RUN = frozenset({"torchtitan"})


def keep_of(name: str, graph: Graph, ops: list[Op], reached: Sequence[Op]) -> set[str]:
    """Policy `name`'s keep set over a region's `ops`: a peer's list whole (`AS_PEERS_RUN`), the
    others only what the region's replay reaches (`reached`, `remat.planning.blocks.replay_reach`)."""
    keep = POLICIES[name](graph, ops)
    return keep if name in AS_PEERS_RUN else keep & {op.name for op in reached}


def keepable(graph: Graph, ops: list[Op], keep: set[str]) -> set[str]:
    """The ops of `keep` a selective policy can keep. Not one whose output the region modifies in
    place (a ResNet's `relu_` or `+=`, in-place outputs included): selective checkpointing refuses
    it. Not autocast's cast of a parameter: autocast caches those for the whole context, so a
    backward run inside the loop's `torch.autocast` replays the region without dispatching them,
    and a policy counting casts then hands a later cast the kept one (a bias for an input: a
    shape error in the backward)."""
    written = {
        graph.tensors[t].storage
        for op in ops
        if op.short.endswith("_")
        for t in op.outputs
        if graph.tensors[t].storage in {graph.tensors[i].storage for i in op.inputs}
    }
    return {
        op.name
        for op in ops
        if op.name in keep
        and not any(graph.tensors[t].storage in written for t in op.outputs)
        and not _casts_a_parameter(graph, op)
    }


def _casts_a_parameter(graph: Graph, op: Op) -> bool:
    return op.short == "_to_copy" and any(
        graph.storages[graph.tensors[t].storage].kind == "param" for t in op.inputs
    )


def dearest_first(graph: Graph, ops: Sequence[Op], seconds: Sequence[float]) -> list[Op]:
    """The ops of `ops` that make new bytes, dearest to recompute per byte they make first (ties in
    forward order): keeping the first n of them is the greedy answer to "least recompute for n
    ops' bytes", so their prefixes are a region's keep sets from a few bytes at a high price per
    byte (a Linear's output) to many at a low one (a GELU's)."""
    priced = []
    for op in ops:
        made = {
            graph.tensors[t].storage
            for t in op.outputs
            if graph.storages[graph.tensors[t].storage].allocated_at == op.index
        }
        nbytes = sum(graph.storages[sid].nbytes for sid in made)
        if nbytes and seconds[op.index] > 0:
            priced.append((-seconds[op.index] / nbytes, op.index, op))
    return [op for *_, op in sorted(priced, key=lambda x: x[:2])]
