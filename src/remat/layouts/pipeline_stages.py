"""Pipeline stages: a zoo model cut into the stages a pipeline runs (`split`, `Stage`).

A stage of `p` keeps a contiguous run of the model's blocks, the embedding on the first stage and
the final norm and output head on the last, under the model's own module names, as torchtitan's
`pipeline_module_split` cuts a model for `torch.distributed.pipelining.PipelineStage`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.layouts.stage_place import StagePlace
from remat.models.gpt import GPT
from remat.models.llama import Llama


@dataclass(frozen=True)
class _Layout:
    """Where a model family keeps its parts, and how a stage runs them in the model's order."""

    embed: tuple[str, ...]  # kept by the first stage
    layers: str  # the ModuleList of blocks, cut into runs
    head: tuple[str, ...]  # kept by the last stage
    buffers: tuple[str, ...]  # needed by every stage
    run_embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    run_layer: Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]
    run_head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _gpt_embed(stage: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device)
    return stage.drop(stage.wte(ids) + stage.wpe(pos))


_LAYOUTS: dict[type[nn.Module], _Layout] = {
    Llama: _Layout(
        embed=("embed_tokens",),
        layers="layers",
        head=("norm", "lm_head"),
        buffers=("freqs_cis",),
        run_embed=lambda stage, ids: stage.embed_tokens(ids),
        # the whole table: the attention cuts it to its sequence (x may be a sequence shard)
        run_layer=lambda stage, layer, x: layer(x, stage.freqs_cis),
        run_head=lambda stage, x: stage.lm_head(stage.norm(x)),
        loss=lambda logits, labels: F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1)
        ),
    ),
    GPT: _Layout(
        embed=("wte", "wpe", "drop"),
        layers="h",
        head=("ln_f", "lm_head"),
        buffers=(),
        run_embed=_gpt_embed,
        run_layer=lambda stage, block, x: block(x),
        run_head=lambda stage, x: stage.lm_head(stage.ln_f(x)),
        loss=lambda logits, labels: F.cross_entropy(
            logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1
        ),
    ),
}


class Stage(StagePlace):
    """One pipeline stage of a zoo model: its blocks `layers` (a ModuleDict keyed by the blocks'
    indices in the model, so that parameter names and plans read as in the whole model), with the
    embedding on the first stage and the final norm and head on the last.

    `forward(x)` takes token ids on the first stage and hidden states on the others, and returns
    hidden states, or the logits on the last stage; `loss_fn(logits, labels)` is the model's
    training loss, the `loss_fn` a torch pipeline schedule takes. The stage shares its modules with
    the model it was cut from: drop the model to free the other stages' parameters."""

    def __init__(self, model: nn.Module, index: int, num_stages: int, layers: range) -> None:
        super().__init__(index, num_stages, layers)
        self.layout = _layout(model)
        if self.is_first:
            for name in self.layout.embed:
                setattr(self, name, getattr(model, name))
        blocks = getattr(model, self.layout.layers)
        setattr(self, self.layout.layers, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        if self.is_last:
            for name in self.layout.head:
                setattr(self, name, getattr(model, name))
        for name in self.layout.buffers:
            self.register_buffer(name, getattr(model, name), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.layout.run_embed(self, x)
        for layer in getattr(self, self.layout.layers).values():
            x = self.layout.run_layer(self, layer, x)
        if self.is_last:
            x = self.layout.run_head(self, x)
        return x

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.layout.loss(logits, labels)


def _layout(model: nn.Module) -> _Layout:
    layout = _LAYOUTS.get(type(model))
    if layout is None:
        known = ", ".join(cls.__name__ for cls in _LAYOUTS)
        cls = type(model)
        raise RematError(
            f"cannot cut a {cls.__name__} ({cls.__module__}) into pipeline stages: remat cuts its "
            f"zoo's {known} and transformers models with a base_model_pp_plan; for a model of "
            "your own, cut it into stage modules (each forward(x) -> the next stage's input, the "
            "last's a loss_fn(output, labels)) and trace each with remat.trace"
        )
    if getattr(model, "loss_chunks", 0):
        raise RematError("a chunked loss (loss_chunks > 0) is not supported on a pipeline stage")
    return layout


def split(model: nn.Module, stages: int, example: torch.Tensor | None = None) -> list[Stage]:
    """`model`'s blocks cut into `stages` contiguous runs, evenly; when they do not divide, the
    first stages get one block more (as `numpy.array_split`; torchtitan's default also weighs the
    embedding and the head as blocks, which this does not). The zoo's Llama and GPT are cut as
    torchtitan cuts them; a transformers model (under remat's `hf:` wrappers too) by its own
    pipeline plan (`remat.layouts.pipeline_hf.HFStage`); any other model with a repeated block
    stack by torch's pipeline frontend, traced on `example`, its first input
    (`remat.layouts.pipeline_exported.ExportedStage`)."""
    from remat.layouts.parallel_plans import inner_model
    from remat.layouts.pipeline_exported import split_exported
    from remat.layouts.pipeline_hf import HFStage, hf_parts

    model = inner_model(model)
    parts = None if type(model) in _LAYOUTS else hf_parts(model)
    if parts is None and type(model) not in _LAYOUTS and example is not None:
        return split_exported(model, stages, example)  # type: ignore[return-value]
    if parts is not None:
        blocks, make = len(getattr(parts[0], parts[1])), HFStage
    else:
        blocks, make = len(getattr(model, _layout(model).layers)), Stage
    if not 1 <= stages <= blocks:
        raise RematError(f"cannot cut {blocks} blocks into {stages} stages: need 1..{blocks}")
    base, extra = divmod(blocks, stages)
    out, start = [], 0
    for i in range(stages):
        stop = start + base + (i < extra)
        out.append(make(model, i, stages, range(start, stop)))
        start = stop
    return out
