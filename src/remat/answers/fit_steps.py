"""The training steps `remat.answers.fit` judges: a model's step at any (batch, seq), traced or
interpolated by a size model (`remat.prediction.sizes.SizeModel`) through traces at nearby sizes
until a trace confirms the answer, with every strategy's per-rank peak on it (`FitSteps`); and how
each precision is traced and held (`PRECISIONS`).

Apart from `remat.answers.fit_rows` (a strategy's row and the search for the largest batch and
sequence) and `remat.answers.fit` (the report and its advice): both ask these steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from remat.device.gpus import Gpu
from remat.errors import InfeasibleBudget, NoBlocksError, RematError
from remat.graph import Graph
from remat.layouts.parallel import ONE_RANK, Layout
from remat.planning import strategies
from remat.planning.planner import Planner
from remat.prediction.estimate import Optimizer, estimate, shard_step
from remat.prediction.loop import Loop
from remat.prediction.sizes import SizeModel, same_graph

Precision = Literal[
    "fp32",
    "bf16",
    "bf16-mixed",
    "fp16-mixed",
    "bf16-fsdp",
    "float8",
    "float8-tensorwise",
    "float8-rowwise",
]


@dataclass(frozen=True)
class PrecisionSetup:
    """How a precision is traced and held: the dtype parameters are built in, the autocast dtype
    of the forward, and the bytes of the sharded master copy per traced parameter byte."""

    param_dtype: str
    autocast: torch.dtype | None = None
    master_scale: int = 1
    #: torchao's float8 linears of this recipe (`remat.models.float8.RECIPES`), or none
    float8: str | None = None

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The built model as this precision trains it: its linears float8 ones where it has
        a float8 recipe (`remat.models.float8.convert_to_float8`)."""
        if self.float8 is not None:
            from remat.models.float8 import convert_to_float8

            convert_to_float8(model, self.float8)
        return model


PRECISIONS: dict[str, PrecisionSetup] = {
    "fp32": PrecisionSetup("fp32"),
    "bf16": PrecisionSetup("bf16"),
    # fp32 parameters and gradients, the forward under torch.autocast(bf16)
    "bf16-mixed": PrecisionSetup("fp32", torch.bfloat16),
    # the same under torch.autocast(fp16) (torch.cuda.amp before bf16; its GradScaler's scale
    # and growth tracker are a few bytes)
    "fp16-mixed": PrecisionSetup("fp32", torch.float16),
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 gathered parameters
    # and compute (traced in bf16, no autocast), fp32 shards of parameters, gradients and state
    "bf16-fsdp": PrecisionSetup("bf16", None, master_scale=2),
    # bf16-fsdp with torchao's Float8Linear (torchtitan's --model.converters float8): tensorwise
    # scales and FSDP's float8 all-gather (torchao's best settings for tensorwise); tensorwise
    # with bf16 all-gather; rowwise (bf16 all-gather: torchao gathers float8 for tensorwise only)
    "float8": PrecisionSetup("bf16", None, master_scale=2, float8="tensorwise-all-gather"),
    "float8-tensorwise": PrecisionSetup("bf16", None, master_scale=2, float8="tensorwise"),
    "float8-rowwise": PrecisionSetup("bf16", None, master_scale=2, float8="rowwise"),
}

Build = Callable[[int, int], tuple[torch.nn.Module, tuple[Any, ...]]]


class FitSteps:
    """Steps by (batch, seq): traced, or interpolated by a `SizeModel` through traces at nearby
    sizes along one axis (batch at a fixed seq, seq at a fixed batch) until `confirm` traces the
    answer; each asked for every strategy's per-rank peak."""

    def __init__(
        self,
        build: Build,
        gpu: Gpu,
        precision: str,
        optimizer: Optimizer,
        shard: int,
        progress: Callable[[str], None] | None,
        layout: Layout = ONE_RANK,
    ) -> None:
        self.build, self.gpu, self.setup = build, gpu, PRECISIONS[precision]
        self.layout = layout
        self.optimizer, self.shard, self.progress = optimizer, shard, progress
        self.simulate_allocator = True
        #: modules outside the blocks FSDP2 wraps on their own (`remat.prediction.gpu_memory.FsdpUnit`)
        self.fsdp_units: tuple[Any, ...] = ()
        #: how the loop treats gradients (`remat.prediction.loop.Loop`): applied to every trace
        self.loop = Loop()
        #: trace a few repeated blocks and lay out the full depth (`remat.tracing.depth`)
        self.replicate_depth = True
        self.traced: dict[tuple[int, int], Graph] = {}
        self.planners: dict[tuple[int, int], Planner] = {}
        self.models: dict[tuple[str, int], SizeModel | None] = {}
        #: `gpu_memories` by (graph, regions, FSDP ranks): a plan judged again (auto's choice
        #: is often a fixed strategy's regions; the searches return to a size) is not walked
        #: again; the memories of the first settings walked, in `ALLOCATOR_SETTINGS`' order
        self.memories: dict[tuple[int, tuple[Any, ...], int], tuple[Graph, list[Any]]] = {}
        #: `rank_peak` by (planner, regions, ranks), the planner kept to tell a new one at its id
        self.rank_peaks: dict[tuple[int, tuple[Any, ...], int], tuple[Planner, int]] = {}

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP2 shards parameters, gradients and optimizer state over: the
        data-parallel ranks times the context-parallel ones, as torchtitan's mesh does it
        (`fully_shard` on its `dp_shard_cp` mesh: CP ranks hold the same parameters)."""
        return self.shard * self.layout.cp

    def fsdp(self) -> Any:
        """FSDP2 over `fsdp_ranks` as the allocator walks it, with `fsdp_units`; None on one rank."""
        from remat.prediction.gpu_memory import Fsdp

        if self.fsdp_ranks == 1:
            return None
        return Fsdp(self.fsdp_ranks, self.setup.master_scale, self.fsdp_units)

    def trace(self, batch: int, seq: int) -> Graph:
        key = (batch, seq)
        if key not in self.traced:
            if self.progress:
                self.progress(f"tracing batch {batch}, seq {seq}")
            graph = self.layout.trace(
                self.build,
                batch,
                seq,
                autocast=self.setup.autocast,
                target=self.gpu.target,
                replicate_depth=self.replicate_depth,
            )
            self.traced[key] = self.loop.apply(graph)
        return self.traced[key]

    def planner(self, batch: int, seq: int) -> Planner:
        key = (batch, seq)
        if key not in self.planners:
            graph = self.traced.get(key) or self.sized(batch, seq) or self.trace(batch, seq)
            self.planners[key] = Planner(graph, self.gpu.profile, self.optimizer)
        return self.planners[key]

    def sized(self, batch: int, seq: int) -> Graph | None:
        """The step at (batch, seq) from a size model along either axis, if one holds there."""
        for axis, fixed, n in (("batch", seq, batch), ("seq", batch, seq)):
            model = self.models.get((axis, fixed))
            graph = None if model is None else model.at(n)
            if graph is not None:
                return graph
        return None

    def model_through(self, axis: str, fixed: int, sizes: list[int]) -> None:
        """The size model along `axis` (at `fixed` of the other), now through traces at `sizes`: a
        line through two batch sizes, a parabola through three sequence lengths; none when a
        size cannot be built."""
        current = self.models.get((axis, fixed))
        if current is not None and current.sizes == tuple(sorted(sizes)):
            return  # every strategy's search starts from the same anchors
        at = (lambda n: (n, fixed)) if axis == "batch" else (lambda n: (fixed, n))
        try:
            graphs = {n: self.trace(*at(n)) for n in sizes}
        except RematError:
            self.models[(axis, fixed)] = None
            raise
        self.models[(axis, fixed)] = SizeModel.of(graphs)

    def confirm(self, axis: str, fixed: int, n: int) -> bool:
        """Trace the step an answer rests on; False (and the axis's model dropped, with every
        step it gave) when the model's graph there differs from the trace or the size cannot be
        built: the search must then run on traces."""
        key = (n, fixed) if axis == "batch" else (fixed, n)
        modelled = self.planners.get(key)
        try:
            graph = self.trace(*key)
        except RematError:
            graph = None
        if graph is not None and (modelled is None or same_graph(modelled.graph, graph)):
            if modelled is None:
                self.planners[key] = Planner(graph, self.gpu.profile, self.optimizer)
            else:  # the model's graph is the trace, to the number: its planner, what it
                # worked out and the walks of its plans stand (`traced` keeps the one graph)
                self.traced[key] = modelled.graph
            return True
        self.models[(axis, fixed)] = None
        self.planners = {k: p for k, p in self.planners.items() if p.graph is self.traced.get(k)}
        return False

    def held_at_every_size(self, batch: int, seq: int) -> int:
        """Bytes one rank holds at once at any batch and sequence, whatever the plan: its
        parameters, buffers, gradients and optimizer state, all live at the optimizer step (the
        gradients not, where the loop steps each one in backward). Where they alone exceed what
        may be held, no plan fits at any size, and the searches need not run. Kept per graph:
        the rows and auto's judgements ask it at each size."""
        graph = self.planner(batch, seq).graph
        ranks, scale = self.fsdp_ranks, self.setup.master_scale
        in_backward = self.loop.optimizer_in_backward

        def held() -> int:
            step = estimate(graph, optimizer=self.optimizer, shard=ranks, master_scale=scale)
            grads = 0 if in_backward else step.grad_bytes
            return step.param_bytes + step.buffer_bytes + step.optimizer_state_bytes + grads

        key = f"held_at_every_size:{self.optimizer}:{ranks}:{scale}:{in_backward}"
        return graph.derived(key, held, graph.storages)

    def rank_peak(self, planner: Planner, plan: Any, shard: int | None = None) -> int:
        """`plan`'s peak per rank: its simulation with parameters, gradients and optimizer state
        sharded over `shard` data-parallel ranks (default: the asked ones) times the
        context-parallel ones (`remat.prediction.estimate.shard_step`), the optimizer step included."""
        shard = (self.shard if shard is None else shard) * self.layout.cp
        if shard == 1 and self.setup.master_scale == 1:
            return plan.predicted_peak_bytes
        key = (id(planner), tuple(plan.regions), shard)
        kept = self.rank_peaks.get(key)
        if kept is None or kept[0] is not planner:  # the searches ask a plan again at each size
            sharded = shard_step(
                planner.graph,
                planner.simulate(plan.regions),
                shard,
                self.optimizer,
                self.setup.master_scale,
            )
            peak = max(max(sharded.timeline), sharded.optimizer_step_bytes)
            kept = self.rank_peaks[key] = (planner, peak)
        return kept[1]

    def gpu_memories(self, batch: int, seq: int, plan: Any, judged_only: bool = False) -> list[Any]:
        """`plan`'s step at (batch, seq) as the GPU reports it, under each allocator setting of
        `remat.prediction.gpu_memory.ALLOCATOR_SETTINGS` (torch's default first: the one rows are judged
        with), per rank of FSDP2 over `shard` ranks; none where a user's --reserve replaces the
        allocator's judgement. `judged_only`: the first setting's alone, for a search that asks
        only whether a step fits (the others are shown for the asked size, never searched):
        one walk instead of one per setting."""
        if not self.simulate_allocator or plan is None:
            return []
        from remat.prediction.gpu_memory import ALLOCATOR_SETTINGS, gpu_memories

        graph = self.planner(batch, seq).graph
        key = (id(graph), tuple(plan.regions), self.fsdp_ranks)
        kept = self.memories.get(key)
        if kept is None or kept[0] is not graph:
            kept = self.memories[key] = (graph, [])
        wanted = 1 if judged_only else len(ALLOCATOR_SETTINGS)
        walked = kept[1]
        if len(walked) < wanted:  # the settings not walked yet, from one step's events
            walked += gpu_memories(
                graph, self.gpu, plan.regions, self.optimizer, self.fsdp(),
                ALLOCATOR_SETTINGS[len(walked) : wanted],
            )  # fmt: skip
        return walked[:wanted]

    def fixed_plans(self, planner: Planner) -> Iterator[Any]:
        """The plan of every appliable fixed strategy the model supports, one at a time."""
        for fixed in strategies.available("eager"):
            if fixed.appliable and not fixed.budgeted:
                with contextlib.suppress(NoBlocksError):
                    yield planner.solve(fixed, planner.estimate.peak_bytes)

    def candidates(self, planner: Planner) -> list[Any]:
        """The plans judged per rank where the whole-model judge cannot rank them: the fixed
        ones and the lowest-peak one."""
        return [*self.fixed_plans(planner), planner.lowest_peak()]

    def auto(self, planner: Planner, usable: int) -> tuple[int, Any]:
        """remat's plan per rank: the least-recompute plan whose per-rank peak fits `usable`, by
        the planner's own solvers on a whole-model budget moved by what sharding saves (and
        lowered by any per-rank excess, a few times); else the plan of least per-rank peak among
        the fixed ones (per-rank judging can order plans differently from the whole model's)."""
        store_all = planner.solve(strategies.get("store_all"), planner.estimate.peak_bytes)
        budget = usable + store_all.predicted_peak_bytes - self.rank_peak(planner, store_all)
        for _ in range(4):
            try:
                p = planner.plan(budget, "auto")
            except InfeasibleBudget:
                break
            peak = self.rank_peak(planner, p)
            if peak <= usable:
                return peak, p
            budget -= peak - usable
        peaks = [(self.rank_peak(planner, p), p) for p in self.candidates(planner)]
        fitting = [(peak, p) for peak, p in peaks if peak <= usable]
        if fitting:
            return min(fitting, key=lambda x: (x[1].recompute_seconds, x[0]))
        return min(peaks, key=lambda x: (x[0], x[1].recompute_seconds))

    def fits(self, strategy: str, batch: int, seq: int, usable: int) -> bool:
        """Whether the strategy's step at (batch, seq) fits `usable` per rank. `auto` fits where
        any fixed plan does (it considers them all), which spares its solvers in a search."""
        if strategy == "auto":
            planner = self.planner(batch, seq)
            if any(self.rank_peak(planner, p) <= usable for p in self.fixed_plans(planner)):
                return True
        return self.peak(strategy, batch, seq, usable)[0] <= usable

    def peak(self, strategy: str, batch: int, seq: int, usable: int) -> tuple[int | None, Any]:
        """The strategy's per-rank peak at (batch, seq), with its plan; for `auto`, the plan that
        fits `usable` at the least recompute, else the one of lowest peak."""
        planner = self.planner(batch, seq)
        try:
            if strategy == "auto":
                return self.auto(planner, usable)
            p = planner.solve(strategies.get(strategy, "eager"), planner.estimate.peak_bytes)
            return self.rank_peak(planner, p), p
        except NoBlocksError:
            return None, None
