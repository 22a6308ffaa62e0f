"""Pipeline stages of a model of one's own: its repeated block stack found as the planner finds
blocks (numbered submodules, `Graph.blocks`), and the model cut at block boundaries by torch's
own pipeline frontend (`torch.distributed.pipelining.pipeline`: the forward exported, its graph
split before the blocks that begin stages), so each stage takes and returns what the model's
forward passes there, with no stage code written for the model.

The model is called on its first input alone (the token ids, images, ...); a stage module is the
frontend's `GraphModule`, with the model's module names. The last stage's loss is the model's
`loss_fn(output, labels)` where it has one, else cross-entropy on logits upcast to fp32 (labels
one dimension fewer than the output), as remat's zoo computes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError


def block_stack(model: nn.Module) -> str | None:
    """The path of the model's repeated blocks: the container of numbered submodules (`h.0`,
    `blocks.3`) holding the most parameters, as `Graph.blocks` picks the numbered calls that
    cover the most of the step. None: no such container."""
    best, most = None, -1
    for path, module in model.named_modules():
        names = [n for n, _ in module.named_children()]
        if len(names) >= 2 and all(n.isdigit() for n in names):
            size = sum(p.numel() for p in module.parameters())
            if size > most:
                best, most = path, size
    return best


class ExportedStage(nn.Module):
    """One stage of a model cut by torch's pipeline frontend (see the module): `module` its part
    of the exported forward, `forward(x)` its input as the model passes it, its output to the
    next stage (the model's output on the last)."""

    def __init__(
        self, module: nn.Module, index: int, num_stages: int, layers: range, loss: Any
    ) -> None:
        super().__init__()
        self.module = module
        self.index, self.num_stages, self.layer_indices = index, num_stages, layers
        self._loss = loss

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> Any:
        out = self.module(x)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out

    def loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._loss is not None:
            return self._loss(output, labels)
        if output.dim() != labels.dim() + 1 or labels.is_floating_point():
            raise RematError(
                f"the last stage's output {tuple(output.shape)} is not logits over labels "
                f"{tuple(labels.shape)}: give the model a loss_fn(output, labels) attribute"
            )
        return F.cross_entropy(output.flatten(0, -2).float(), labels.flatten())

    def extra_repr(self) -> str:
        first, last = self.layer_indices.start, self.layer_indices.stop - 1
        return f"stage {self.index} of {self.num_stages}, blocks {first}..{last}"


def split_exported(model: nn.Module, stages: int, example: torch.Tensor) -> list[ExportedStage]:
    """`model` cut into `stages` at its block stack's boundaries (evenly, the first stages one
    block more when they do not divide), traced on `example` (its first input; meta tensors do)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    stack = block_stack(model)
    cls = type(model)
    if stack is None:
        raise RematError(
            f"cannot cut a {cls.__name__} ({cls.__module__}) into pipeline stages: it has no "
            "repeated blocks (a ModuleList or Sequential of numbered submodules); cut it into "
            "stage modules of your own and trace each with remat.trace"
        )
    blocks = len(list(model.get_submodule(stack).children()))
    if not 1 <= stages <= blocks:
        raise RematError(f"cannot cut {blocks} blocks into {stages} stages: need 1..{blocks}")
    base, extra = divmod(blocks, stages)
    runs, start = [], 0
    for i in range(stages):
        runs.append(range(start, start + base + (i < extra)))
        start = runs[-1].stop
    prefix = f"{stack}." if stack else ""
    spec = {f"{prefix}{r.start}": SplitPoint.BEGINNING for r in runs[1:]}
    try:
        pipe = pipeline(model, mb_args=(example,), split_spec=spec)
    except Exception as err:  # export's many failures, named
        raise RematError(
            f"torch's pipeline frontend could not cut {cls.__name__} on its first input alone "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}): cut it into "
            "stage modules of your own and trace each with remat.trace"
        ) from err
    for i in range(1, stages):
        taken = [n.name for n in pipe.get_stage_module(i).graph.nodes if n.op == "placeholder"]
        if len(taken) > 1:
            raise RematError(
                f"torch's pipeline frontend cut {cls.__name__} so that stage {i} takes "
                f"{len(taken)} tensors ({', '.join(taken)}: what the model computes once and "
                "passes to every block, such as a mask, besides the hidden states); remat's "
                "stages hand on one tensor: cut it into stage modules of your own and trace each "
                "with remat.trace"
            )
    loss = getattr(model, "loss_fn", None)
    return [
        ExportedStage(
            _on_the_tracers_device(pipe.get_stage_module(i), example), i, stages, runs[i], loss
        )
        for i in range(stages)
    ]


def _on_the_tracers_device(module: nn.Module, example: torch.Tensor) -> nn.Module:
    """`module` with the device its graph names made the CPU where the model was cut on meta
    tensors: export writes the example's device into the graph wherever the model asked for a
    tensor's (GPT-2's `position_embeds.to(inputs_embeds.device)`, an `arange(device=...)`), and
    `remat.trace` runs a meta model on fake CPU tensors, which met meta ones there."""
    if example.device.type != "meta":
        return module
    meta, cpu = torch.device("meta"), torch.device("cpu")
    for part in module.modules():  # GraphModules, and export's InterpreterModules
        graph = getattr(part, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.kwargs.get("device") in (meta, "meta"):
                node.kwargs = {**node.kwargs, "device": cpu}
        if isinstance(part, torch.fx.GraphModule):
            part.recompile()
    return module
