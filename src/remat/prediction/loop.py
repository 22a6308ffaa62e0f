"""Training loops that move the peak, as changes to the traced step they run.

`optimizer_in_backward(graph)`: torchtune's `optimizer_in_bwd=True` (and any loop that steps each
parameter from a `register_post_accumulate_grad_hook` and sets its `.grad` to None): a parameter's
gradient is freed as soon as its last accumulation has run and its own step is done, so the
gradients never all live at once. The optimizer state still does. The step's own transient moves
into the backward, one parameter at a time (foreach over a one-tensor list: that parameter's
bytes); it is not placed there: the step is counted at the end as before, where, the gradients
gone, it is rarely the peak.
"""

from __future__ import annotations

from dataclasses import replace

from remat.graph import Graph


def optimizer_in_backward(graph: Graph) -> Graph:
    """`graph` with every gradient storage released after the last op that writes it (its
    `AccumulateGrad`, or the last in-place accumulation of a parameter used twice), as a hook that
    steps and drops each gradient in backward leaves it. `info["optimizer_in_backward"]` says so."""
    last_write: dict[int, int] = {}
    for op in graph.ops:
        for t in op.outputs:
            sid = graph.tensors[t].storage
            if graph.storages[sid].kind == "grad":
                last_write[sid] = op.index
    storages = {
        sid: replace(s, released_after=last_write.get(sid, s.allocated_at))
        if s.kind == "grad" and s.allocated_at is not None
        else s
        for sid, s in graph.storages.items()
    }
    return replace(graph, storages=storages, info={**graph.info, "optimizer_in_backward": True})
