"""One joint graph as the strategies' `solve_compiled` sees it: its `Graph`, the user's
selective-checkpoint tags and the recompute costs, with the save sets every compiled strategy starts
from (store-all, the least-traffic min-cut, the cheapest within a budget). Torch-free: the compiled
backend (`remat.applying.compiled`) builds it from AOTAutograd's joint graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from remat.device.cost import DeviceProfile, fused_op_seconds_all, is_matmul
from remat.errors import RematError
from remat.graph import Graph, Op
from remat.planning.solvers.mincut import JointProblem, joint_problem, mincut
from remat.planning.solvers.saveset import (
    Offloadable,
    PeakModel,
    SaveSet,
    describe_save_set,
    joint_peak,
    save_set_within,
)


@dataclass
class JointContext:
    """One joint graph prepared for a compiled strategy's `solve_compiled`: its `Graph`, the user's
    selective-checkpoint tags, and the recompute costs on `profile`. Torch-free, like the
    strategies that read it."""

    graph: Graph
    must_save: frozenset[str]  # op names tagged MUST_SAVE
    must_recompute: frozenset[str]  # op names tagged MUST_RECOMPUTE or PREFER_RECOMPUTE
    profile: DeviceProfile
    peak_model: PeakModel = joint_peak
    #: what the budgeted save set may move to host memory per tensor (None: nothing)
    offload: Offloadable | None = None

    @cached_property
    def op_seconds(self) -> list[float]:
        return fused_op_seconds_all(self.graph, self.profile)

    def rules(self, ban_matmuls: bool) -> tuple[Callable[[Op], bool], Callable[[Op], bool]]:
        """Which ops may not be recomputed and which may not be saved: the user's tags, and with
        `ban_matmuls` AOTAutograd's ban on recomputing compute-intensive ops (the pure traffic
        model would re-run every matmul)."""

        def never_recompute(op: Op) -> bool:
            return op.name in self.must_save or (ban_matmuls and is_matmul(op))

        def never_save(op: Op) -> bool:
            return op.name in self.must_recompute

        return never_recompute, never_save

    def problem(self, ban_matmuls: bool = False) -> JointProblem:
        return joint_problem(self.graph, *self.rules(ban_matmuls))

    @cached_property
    def store_all(self) -> SaveSet:
        """Everything backward reads saved: the reference for budgets given as a share."""
        problem = self.problem()
        return describe_save_set(
            self.graph, problem, set(problem.needed), self.op_seconds, self.peak_model
        )

    @cached_property
    def min_cut(self) -> SaveSet:
        """The article's least-traffic cut, compute-intensive ops never recomputed."""
        problem = self.problem(ban_matmuls=True)
        never_recompute, never_save = self.rules(ban_matmuls=True)
        try:
            cut = mincut(self.graph, never_recompute=never_recompute, never_save=never_save)
        except RematError as err:
            raise RematError(f"compiled graph: {err}") from None
        return describe_save_set(
            self.graph,
            problem,
            indices_of(problem, list(cut.saved)),
            self.op_seconds,
            self.peak_model,
        )

    def cheapest_within(self, budget_bytes: int | None) -> SaveSet:
        """The cheapest save set (recompute + traffic, + copies where `offload` lets it move
        storages to host memory) whose predicted peak fits the budget."""
        return save_set_within(
            self.graph,
            self.problem(),
            self.op_seconds,
            self.profile.bandwidth,
            budget_bytes,
            self.peak_model,
            self.offload,
        )

    @property
    def fixed_bytes(self) -> int:
        """Parameters, buffers, inputs and gradients: there whatever is saved."""
        graph = self.graph
        return sum(
            s.nbytes for s in graph.storages.values() if s.kind in ("param", "buffer", "input")
        ) + sum(graph.tensors[t].nbytes for t in graph.info["backward_outputs"])


def indices_of(problem: JointProblem, names: list[str]) -> set[int]:
    by_name = {v.name: i for i, v in enumerate(problem.values)}
    return {by_name[n] for n in names if n in by_name}
