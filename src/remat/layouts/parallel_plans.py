"""Tensor-parallel plans of the models users bring: a Hugging Face model's own plan
(`base_model_tp_plan`, as `PreTrainedModel.tp_plan` gathers it with its head's), or a
`tp_plan` attribute on a model of one's own, laid out with torch's own parallel styles.

transformers names its styles by strings ("colwise", "rowwise", "embedding_rowwise", ...) and
applies them with classes of its own; remat maps each to torch's `ColwiseParallel` /
`RowwiseParallel` / `SequenceParallel` with the same input and output layouts (`torch_styles`),
so that the rank's step is DTensor's, as for the zoo's plans. A style without a torch counterpart (packed
gate-up projections, experts, MLA's compressed K/V) is refused by name, with how to give a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.errors import RematError


def torch_styles() -> dict[str, Callable[[], Any] | None]:
    """transformers' style names (`transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES`)
    as torch's styles of the same layouts; None: the module stays whole on every rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # torch's row-wise style on an nn.Embedding shards the vocabulary (dim 0), column-wise
        # the embedding width (dim 1), as transformers' EmbeddingParallel(shard_dim=0 / 1)
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
        "replicate": None,
        "local_params": None,
    }


def inner_model(model: nn.Module) -> nn.Module:
    """The user's model under remat's wrappers of `hf:` and `torchtitan:` models (`HFLogits`,
    `HFLoss`, `TorchtitanStep`), which only call it: the plan's module paths are the inner
    model's."""
    from remat.models.frameworks import TorchtitanStep
    from remat.models.hf import HFLogits, HFLoss

    while isinstance(model, (HFLogits, HFLoss, TorchtitanStep)):
        model = model.model
    return model


@dataclass(frozen=True)
class ModelPlan:
    """A model's tensor-parallel plan: module path patterns (`*` for any one name, as
    `parallelize_module` reads them) to torch parallel styles, where it came from, and the
    modules left whole on every rank (and why)."""

    styles: dict[str, Any]
    source: str
    names: dict[str, str]  # pattern -> the style's name, for the header
    whole: tuple[str, ...] = ()

    def describe(self) -> str:
        """Which modules are sharded, for a header: each style with its modules, a pattern
        shortened to its last name ("q_proj")."""
        by_style: dict[str, list[str]] = {}
        for pattern, name in self.names.items():
            short = pattern.rsplit(".", 1)[-1] if "*" in pattern else pattern
            by_style.setdefault(name, []).append(short)
        parts = [f"{name} {', '.join(paths)}" for name, paths in by_style.items()]
        whole = f"; whole on every rank: {', '.join(self.whole)}" if self.whole else ""
        return f"{self.source}: " + "; ".join(parts) + whole


def plan_of(model: nn.Module, plan: dict[str, Any] | None = None) -> ModelPlan | None:
    """The tensor-parallel plan of `model` (already unwrapped, `inner_model`): `plan` if given,
    else its `tp_plan` attribute (transformers' `PreTrainedModel.tp_plan`: its config's
    `base_model_tp_plan` under the base model's prefix, and its head's). None: it has none."""
    given = plan if plan is not None else getattr(model, "tp_plan", None)
    if not given:
        return None
    source = (
        "your plan"
        if plan is not None
        else f"transformers' plan of {type(model).__name__}"
        if hasattr(model, "base_model_prefix")
        else f"{type(model).__name__}.tp_plan"
    )
    known = torch_styles()
    styles, names = {}, {}
    for pattern, style in given.items():
        if not isinstance(style, str):
            styles[pattern], names[pattern] = style, type(style).__name__
            continue
        if style not in known:
            raise RematError(
                f"{type(model).__name__}'s tensor-parallel plan puts {pattern!r} under "
                f"{style!r}, which has no torch counterpart remat knows ({', '.join(known)}): "
                "give remat a plan of torch parallel styles (tensor_parallel(model, degree, "
                "plan={path: ColwiseParallel(), ...})), or lay the model out with torch's "
                "parallelize_module inside remat.layouts.parallel.fake_ranks and trace it"
            )
        if known[style] is not None:
            styles[pattern], names[pattern] = known[style](), style
    return ModelPlan(styles, source, names, _untied_if_split(model, names))


def _untied_if_split(model: nn.Module, names: dict[str, str]) -> tuple[str, ...]:
    """Modules sharing a weight (a head tied to the embedding) that the plan would shard along
    different dimensions: left whole, as one parameter cannot be both."""
    import fnmatch

    dim = {"colwise": 0, "colwise_gather_output": 0, "colwise_rep": 0, "embedding_rowwise": 0}
    dim |= {"rowwise": 1, "rowwise_split_input": 1, "rowwise_rep": 1, "embedding_colwise": 1}
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            owners.setdefault(id(weight), []).append(path)
    whole = []
    for paths in owners.values():
        if len(paths) < 2:
            continue
        styles = {
            next((n for p, n in names.items() if fnmatch.fnmatchcase(path, p)), None)
            for path in paths
        }
        if len({dim.get(s, -1) if s else None for s in styles}) > 1:
            whole += paths
    return tuple(whole)


def apply_plan(model: nn.Module, plan: ModelPlan, mesh: Any) -> None:
    """Lay `model` out by `plan` on `mesh`, in place; weights tied before stay tied (sharded
    alike, the second module takes the first's DTensor)."""
    import fnmatch

    from torch.distributed.tensor.parallel import parallelize_module

    tied: dict[int, list[tuple[nn.Module, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            tied.setdefault(id(weight), []).append((module, path))
    styles = {
        p: s
        for p, s in plan.styles.items()
        if not any(fnmatch.fnmatchcase(w, p) for w in plan.whole)
    }
    unmatched = [p for p in styles if not _matches(model, p)]
    if unmatched:
        raise RematError(
            f"{plan.source}: no module of {type(model).__name__} at {', '.join(unmatched)}; "
            "plan keys are module paths (model.named_modules()), '*' for any one name"
        )
    parallelize_module(model, mesh, styles)
    for owners in tied.values():
        first, _ = owners[0]
        for module, _ in owners[1:]:
            module.weight = first.weight


def _matches(model: nn.Module, pattern: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(path, pattern) for path, _ in model.named_modules())


def no_plan_message(model: nn.Module, degree: int) -> str:
    """What to do when `model` has no plan: its class named, and the two ways to give one."""
    cls = type(model)
    return (
        f"no tensor-parallel plan for {cls.__name__} ({cls.__module__}): give it a `tp_plan` "
        "attribute (module path -> 'colwise' | 'rowwise' | 'embedding_rowwise' | "
        "'colwise_gather_output' or a torch ParallelStyle, '*' for any one name, e.g. "
        "{'blocks.*.attn.qkv': 'colwise', 'blocks.*.attn.out': 'rowwise'}), pass "
        f"tensor_parallel(model, {degree}, plan=...), or lay it out with torch's "
        "parallelize_module inside remat.layouts.parallel.fake_ranks and trace it "
        "(remat's zoo: Llama, MegatronGPT; transformers models with a base_model_tp_plan)"
        + (
            "; a torchtitan model lays itself out: model.parallelize(parallel_dims) inside "
            "fake_ranks, then trace it"
            if cls.__module__.startswith("torchtitan")
            else ""
        )
    )
