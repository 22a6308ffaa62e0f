"""Tensor and sequence parallelism with torch's own engine, for one rank's trace.

A tensor-parallel step is traced as its rank runs it: the model is laid out with
`torch.distributed.tensor.parallel.parallelize_module` (DTensor parameters, the collectives of
the parallel styles), and the tracer records what DTensor's dispatch runs on this rank's local
shards (`remat.tracing.recorder.Tracer.run_wrapper_op`): local shapes, local FLOPs, the all-reduces,
all-gathers and reduce-scatters, and the shards autograd saves. No real ranks are needed: torch's
fake process group answers every collective, so a rank of a 70B layout is traced on a laptop.

`tensor_parallel` lays out the zoo's transformers as torchtitan and Megatron-LM do (column-parallel
QKV / gate / up / fc1, row-parallel output / down / fc2; with `sequence_parallel`, the norms,
dropouts and residual stream sharded along the sequence and gathered before the column-parallel
linears). A model of one's own is laid out by calling `parallelize_module` with its plan inside
`fake_ranks`, then traced as any model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from torch import nn

from remat.device.targets import get_target
from remat.errors import RematError, TraceError
from remat.tracing.fsdp import fsdp_sharded_as_bare as fsdp_sharded_as_bare  # 0.4's path
from remat.tracing.fsdp import is_fsdp_sharded as is_fsdp_sharded
from remat.tracing.trace import trace


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of `world_size` ranks, this process being `rank`, for the duration:
    collectives return at once with tensors of the right shapes (torch's `fake` backend). An
    existing process group (under torchrun) is used as is and left alone."""
    import torch.distributed as dist

    if world_size < 1:
        raise RematError(f"world_size={world_size}: a layout needs at least one rank")
    if dist.is_initialized():
        if dist.get_world_size() < world_size:
            raise RematError(
                f"this process's group has {dist.get_world_size()} ranks, the layout needs "
                f"{world_size}: plan outside the training job, or launch it on {world_size} ranks"
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tensor_parallel(
    model: nn.Module,
    degree: int,
    *,
    sequence_parallel: bool | None = None,
    mesh: Any = None,
    plan: dict[str, Any] | None = None,
) -> nn.Module:
    """Lay `model` out over `degree` tensor-parallel ranks of `mesh` (default: a 1-D CPU mesh
    over the current process group's first `degree` ranks), in place, and return it.

    The zoo's Llama and Megatron-style GPT take torchtitan's / Megatron-LM's plan (with
    `sequence_parallel`, the Megatron stack, which has no embedding, takes this rank's sequence
    shard); any other model its own plan (`remat.layouts.parallel_plans`): `plan` if given, else
    a Hugging Face model's (`base_model_tp_plan`, found under remat's `hf:` wrappers) or a
    `tp_plan` attribute of one's own, which has no sequence parallelism unless it says so.
    `layout_words(model)` says afterwards which modules were sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if degree < 1:
        raise RematError(f"tensor-parallel degree {degree}: must be at least 1")
    layers = getattr(model, "layers", None)
    plan_of = _PLANS.get(type(model).__name__)
    if plan is not None or plan_of is None or layers is None:
        return _tensor_parallel_by_plan(model, degree, sequence_parallel, mesh, plan)
    sequence_parallel = bool(sequence_parallel)
    _check_divisible(model, degree)
    if degree == 1:
        return model
    if mesh is None:
        mesh = init_device_mesh("cpu", (degree,))
    top, per_layer = plan_of(sequence_parallel, _tied_embeddings(model))
    if top:
        parallelize_module(model, mesh, top)
    for layer in layers:
        parallelize_module(layer, mesh, per_layer)
    tied = " (head tied to the embedding: both whole)" if _tied_embeddings(model) else ""
    _LAID_OUT[model] = (
        f"{'torchtitan' if type(model).__name__ == 'Llama' else 'Megatron-LM'}'s plan of "
        f"{type(model).__name__}{tied}",
        sequence_parallel,
    )
    return model


#: What `tensor_parallel` did to each model it laid out: whose plan sharded which modules, in
#: words, and whether with sequence parallelism (`laid_out`).
_LAID_OUT: WeakKeyDictionary[nn.Module, tuple[str, bool]] = WeakKeyDictionary()


def laid_out(model: nn.Module) -> tuple[str, bool] | None:
    """How `tensor_parallel` laid `model` out: whose plan sharded which modules, in words, and
    whether with sequence parallelism; None if it did not."""
    return _LAID_OUT.get(model)


def layout_words(model: nn.Module) -> str | None:
    """`laid_out` in one phrase ("transformers' plan of LlamaForCausalLM: colwise q_proj, ...,
    no sp")."""
    got = laid_out(model)
    return None if got is None else got[0] + (" + sp" if got[1] else ", no sp")


def default_sequence_parallel(model: nn.Module) -> bool:
    """Whether a layout that does not say takes sequence parallelism: the zoo's transformers as
    torchtitan lays them out do; a model laid out by its own plan does as its plan says (no
    transformers plan does)."""
    return type(model).__name__ in _PLANS and hasattr(model, "layers")


def _tensor_parallel_by_plan(
    model: nn.Module,
    degree: int,
    sequence_parallel: bool | None,
    mesh: Any,
    plan: dict[str, Any] | None,
) -> nn.Module:
    """`tensor_parallel` for a model laid out by its own plan (`parallel_plans.plan_of`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from remat.layouts.parallel_plans import apply_plan, inner_model, no_plan_message, plan_of

    inner = inner_model(model)
    found = plan_of(inner, plan)
    if found is None:
        raise RematError(no_plan_message(inner, degree))
    if sequence_parallel:
        raise RematError(
            f"sequence parallelism is not in {found.source}: leave it out (--no-sp), or give a "
            "plan with torch's SequenceParallel on the norms and the layouts between them "
            "(tensor_parallel(model, degree, plan=...))"
        )
    _check_heads(inner, degree)
    if degree > 1:
        apply_plan(inner, found, mesh if mesh is not None else init_device_mesh("cpu", (degree,)))
    _LAID_OUT[model] = (found.describe(), False)
    return model


def _check_heads(model: nn.Module, degree: int) -> None:
    """A Hugging Face config's heads must split over the ranks (each rank its share of heads)."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, field, None)
        if isinstance(n, int) and n % degree:
            raise RematError(
                f"{type(model).__name__}: {field}={n} does not split over tensor-parallel degree "
                f"{degree}: choose a degree that divides it"
            )


def _check_divisible(model: nn.Module, degree: int) -> None:
    """Heads (and K/V heads) and hidden widths must split evenly over the ranks, as in
    torchtitan; say which does not."""
    first = model.layers[0]
    attn = getattr(first, "self_attn", None)
    heads = {
        "heads": getattr(attn, "n_heads", None) or getattr(first, "n_heads", None),
        "key/value heads": getattr(attn, "n_kv_heads", None),
    }
    for what, n in heads.items():
        if n is not None and n % degree:
            raise RematError(
                f"{n} {what} do not split over tensor-parallel degree {degree}: choose a degree "
                "that divides them"
            )


def _tied_embeddings(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    return head is not None and embed is not None and head.weight is embed.weight


def _llama_plan(sequence_parallel: bool, tied: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """torchtitan's Llama plan (`apply_tp`), with Hugging Face's module names and the logits
    gathered (loss parallelism is not modelled: each rank holds the whole logits). A head tied to
    the embedding (Llama 3.2 1B and 3B) stays whole on every rank, as sharding the two along
    different dimensions would untie them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if tied:
        top = {}
        if sequence_parallel:
            top = {
                "embed_tokens": PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Shard(1)
                ),
                "norm": SequenceParallel(),
                "lm_head": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            }
    elif not sequence_parallel:
        top = {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    else:
        top = {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    if not sequence_parallel:
        layer = {
            **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
            "mlp.down_proj": RowwiseParallel(),
        }
        return top, layer
    layer = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return top, layer


def _megatron_plan(sequence_parallel: bool, tied: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Megatron-LM's layer (Shoeybi et al. 2019; Korthikanti et al. 2022 for the sequence
    parallel regions), sequence-first: with sequence parallelism the column-parallel linears
    gather the sequence-sharded input and the row-parallel ones reduce-scatter their output."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        columns, rows, norms = ColwiseParallel(), RowwiseParallel(), {}
    else:
        columns = ColwiseParallel(input_layouts=Shard(0))
        rows = RowwiseParallel(output_layouts=Shard(0))
        norms = {n: SequenceParallel(sequence_dim=0) for n in ("ln_1", "ln_2")}
    layer = {"qkv": columns, "proj": rows, "fc1": columns, "fc2": rows, **norms}
    return {}, layer


_PLANS = {"Llama": _llama_plan, "MegatronGPT": _megatron_plan}


@dataclass(frozen=True)
class Layout:
    """How one step is laid out over ranks besides FSDP2's data-parallel sharding (`shard`
    elsewhere): `tp` tensor-parallel ranks (with sequence parallelism, as torchtitan lays out
    tensor parallelism) and `cp` context-parallel ranks, each holding `seq / cp` tokens of every
    sequence: on a CUDA target, traced under torch's own `context_parallel` (its ring attention's
    collectives, per-step attention calls and merges); elsewhere as the step at `seq / cp`
    (`trace`, docs/parallelism.md)."""

    tp: int = 1
    cp: int = 1
    #: None: as the model's plan has it (the zoo's with, transformers' without; `--sp`/`--no-sp`)
    sequence_parallel: bool | None = None
    #: pipeline stages, one per rank (`remat.layouts.pipeline`), the micro-batches of a step (default:
    #: one per stage) and torch's schedule that runs them
    pp: int = 1
    microbatches: int = 0
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name, degree in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp)):
            if degree < 1:
                raise RematError(f"--{name} {degree}: a degree is at least 1")
        if self.microbatches < 0:
            raise RematError(f"--microbatches {self.microbatches}: give 1 or more")
        if not self.microbatches:
            object.__setattr__(self, "microbatches", self.pp)

    @property
    def ranks(self) -> int:
        """Ranks one data-parallel replica spans."""
        return self.tp * self.cp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages: one per rank, two under interleaved 1F1B (torchtitan's default)."""
        return self.pp * (2 if self.schedule == "interleaved-1f1b" else 1)

    def local_seq(self, seq: int) -> int:
        """This rank's tokens of a `seq`-token sequence."""
        if seq % self.cp:
            raise RematError(
                f"sequence {seq} does not split into {self.cp} context-parallel chunks: choose a "
                f"multiple of {self.cp}"
            )
        return seq // self.cp

    def trace(self, build: Any, batch: int, seq: int, **trace_kwargs: Any) -> Any:
        """One rank's step of the model `build` returns, laid out and traced on fake tensors
        (`remat.trace`) with a fake process group of `tp` (or `cp`) ranks.

        Context parallelism alone on a CUDA target runs torch's own: the model built at the
        whole `seq`, its token inputs sharded by `context_parallel` (round-robin chunks for
        causal load balancing) and attention run by its ring (`_templated_ring_attention`: the
        K/V all-gather, one attention call per ring step against the other ranks' keys, the
        fp32 merge of outputs and log-sum-exps), so what the rank saves and computes is torch's
        (`graph.info["context_parallel"]` says "torch ring attention"). Elsewhere (a CPU target,
        whose attention kernels torch's ring does not take; tensor parallelism too; a length
        torch's ring cannot split) the step at `seq / cp` stands for it ("local chunk")."""
        if self.cp > 1 and self.tp == 1 and get_target(trace_kwargs.get("target")).is_cuda:
            with contextlib.suppress(_RingUnavailable):
                return self._trace_ring(build, batch, seq, **trace_kwargs)
        model, inputs = build(batch, self.local_seq(seq))
        if self.tp == 1:
            graph = trace(model, *inputs, **trace_kwargs)
        else:
            with fake_ranks(self.tp):
                self.lay_out(model)
                graph = trace(model, *inputs, **trace_kwargs)
            graph.info["tp_plan"] = laid_out(model)
        if self.cp > 1:
            graph.info["context_parallel"] = "local chunk (seq / cp)"
        return graph

    def lay_out(self, model: nn.Module) -> nn.Module:
        """`model` laid out over this layout's `tp` ranks (inside `fake_ranks`), with sequence
        parallelism as asked, else as its plan has it (`default_sequence_parallel`)."""
        sp = self.sequence_parallel
        if sp is None:
            sp = default_sequence_parallel(model)
        return tensor_parallel(model, self.tp, sequence_parallel=sp)

    def _trace_ring(self, build: Any, batch: int, seq: int, **trace_kwargs: Any) -> Any:
        """The step under torch's `context_parallel` over `cp` fake ranks (see `trace`); raises
        `_RingUnavailable` where torch's ring cannot run it."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        self.local_seq(seq)
        if seq % (2 * self.cp):  # round-robin load balancing cuts 2 x cp chunks
            raise _RingUnavailable
        model, inputs = build(batch, seq)
        buffers = [t for t in inputs if hasattr(t, "dim") and t.dim() >= 2 and t.shape[1] == seq]
        with fake_ranks(self.cp):
            mesh = init_device_mesh("cpu", (self.cp,))
            try:
                with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
                    graph = trace(model, *inputs, **trace_kwargs)
            except (TraceError, NotImplementedError, RuntimeError) as err:
                raise _RingUnavailable from err
        graph.info["context_parallel"] = "torch ring attention"
        return graph

    def describe(self, graph: Any = None, tp_plan: tuple[str, bool] | None = None) -> str:
        """The layout in words; with a rank's traced `graph`, how context parallelism was traced
        in it (`trace`) and which modules its tensor-parallel plan sharded (or `tp_plan`, as
        `laid_out` gives it): "tp 2 + sp (torchtitan's plan of Llama)"."""
        got = tp_plan if graph is None else graph.info.get("tp_plan")
        words, sp = got if got else (None, self.sequence_parallel)
        tp = f"tp {self.tp}" + (" + sp" if sp else "") + (f" ({words})" if words else "")
        parts = [tp] * (self.tp > 1)
        parts += [f"cp {self.cp}"] * (self.cp > 1)
        parts += [f"pp {self.pp} ({self.schedule}, {self.microbatches} micro-batches)"] * (
            self.pp > 1
        )
        ring = None if graph is None else graph.info.get("context_parallel")
        return ", ".join(parts) + (f" ({ring})" if ring else "")


class _RingUnavailable(Exception):
    """torch's ring attention cannot run this step (`Layout._trace_ring`)."""


#: No tensor or context parallelism: one rank's step is the step.
ONE_RANK = Layout()


def regions_across_fsdp_units(
    plan: Any, root: nn.Module, will_shard: Collection[str] = ()
) -> list[tuple[str, ...]]:
    """The regions of `plan` (module paths under `root`) whose modules FSDP gathers as separate
    units: the region's first module calls the others' forwards itself, outside the hooks that
    gather their parameters, so FSDP cannot run it (FSDP2: "mixed torch.Tensor and DTensor";
    FSDP1: "mat2 must be a matrix"). A module's unit is the innermost FSDP1 wrapper or
    `fully_shard`ed module holding it, or one of the paths in `will_shard` (units a wrapper will
    make, for a plan made before it does)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    named = dict(root.named_modules())
    coming = {id(named[p]) for p in will_shard if p in named}
    unit_of: dict[int, int | None] = {}
    stack: list[tuple[nn.Module, int | None]] = [(root, None)]
    while stack:
        module, unit = stack.pop()
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)) or id(module) in coming:
            unit = id(module)
        unit_of[id(module)] = unit
        stack.extend((child, unit) for child in module.children())
    return [r.modules for r in plan.regions if len({unit_of[id(named[p])] for p in r.modules}) > 1]
