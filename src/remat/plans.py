"""A plan is data: which regions are checkpointed and which ops' outputs each keeps, with the cost
it predicts. It round-trips through JSON and applies to any model of the same architecture, because
it names regions by module path and ops by their stable names."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.cost import PROFILES, op_seconds_all
from remat.errors import RematError
from remat.graph import Graph
from remat.schedule import Region, simulate
from remat.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class SavedTensor:
    name: str  # the stable name of the op that made it
    op: str  # aten target
    bytes: int


@dataclass(frozen=True)
class Plan:
    strategy: str
    budget_bytes: int | None
    regions: tuple[Region, ...]
    predicted_peak_bytes: int
    held_bytes: int  # live at the end of the forward for the backward (`Simulation.held_bytes`)
    recompute_flops: int
    recompute_seconds: float
    forward_flops: int
    device: str
    reason: str
    saved: tuple[SavedTensor, ...] = ()
    recomputed: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def recompute_flops_share(self) -> float:
        """Extra FLOPs as a share of the forward's (full checkpointing is about 100% of the forward,
        i.e. about 33% of a step)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["regions"] = [asdict(r) for r in self.regions]
        d["saved"] = [asdict(s) for s in self.saved]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        if "held_bytes" not in d:  # written before the two byte figures became one
            d["held_bytes"] = d.pop("retained_bytes", 0)
        d.pop("saved_bytes", None)
        old = next((r for r in d["regions"] if r["keep"] and "keep_keys" not in r), None)
        if old is not None:
            raise RematError(
                f"plan region {old['modules'][0]!r} names its kept ops by position (a plan written "
                "by remat before 0.2, which real runs did not always honour): make the plan again"
            )
        d["regions"] = tuple(
            Region(
                modules=tuple(r["modules"]),
                first_op=r["first_op"],
                last_op=r["last_op"],
                keep=tuple(r["keep"]),
                keep_keys=tuple(tuple(k) for k in r.get("keep_keys", ())),
                random=r.get("random", True),
            )
            for r in d["regions"]
        )
        d["saved"] = tuple(SavedTensor(**s) for s in d["saved"])
        d["recomputed"] = tuple(d["recomputed"])
        return cls(**d)

    def explain(self, graph: Graph) -> list[dict[str, Any]]:
        """Every activation autograd saves in store-all, with what this plan does with it, what
        recomputing it costs on the plan's device profile, and why."""
        profile = PROFILES.get(self.device, PROFILES["cpu"])
        op_seconds = op_seconds_all(graph, profile)
        if self.details.get("path") == "compile":
            return self._explain_compiled(graph, op_seconds)
        kept = {s.name for s in self.saved}
        recomputed = set(self.recomputed)
        rows = []
        for sid in graph.saved_storages:
            producer = graph.producer_op(sid)
            name = producer.name if producer is not None else "<input>"
            region = next((r for r in self.regions if r.covers(producer and producer.index)), None)
            if producer is None:
                why = "a model input: it exists anyway"
            elif name in kept and region is not None:
                why = f"kept inside checkpointed {region.modules[0]} by the policy: expensive to recompute"
            elif name in kept:
                why = "outside every checkpoint region: autograd keeps it"
            elif name in recomputed:
                why = f"recomputed when the backward reaches {region.modules[0] if region else '?'}"
            else:
                why = "dropped and not needed again (recomputation stops before it)"
            rows.append(
                {
                    "name": name,
                    "op": producer.target if producer is not None else "",
                    "bytes": graph.storages[sid].nbytes,
                    "decision": "recompute" if name in recomputed else "keep",
                    "recompute_seconds": op_seconds[producer.index]
                    if producer is not None
                    else 0.0,
                    "why": why,
                }
            )
        return rows

    def _explain_compiled(self, graph: Graph, op_seconds: list[float]) -> list[dict[str, Any]]:
        """A compiled plan on its joint graph: each value saved across the forward/backward
        boundary, and each forward op the backward graph recomputes."""
        rows = []
        for s in self.saved:
            op = graph.op_by_name.get(s.name.partition(":")[0])
            rows.append(
                {
                    "name": s.name,
                    "op": s.op,
                    "bytes": s.bytes,
                    "decision": "keep",
                    "recompute_seconds": op_seconds[op.index] if op is not None else 0.0,
                    "why": "a forward input: backward reads it (1x traffic)"
                    if op is None
                    else f"saved by the {self.strategy} choice: backward reads it (2x traffic) "
                    "instead of recomputing it",
                }
            )
        for name in self.recomputed:
            op = graph.op_by_name[name]
            rows.append(
                {
                    "name": name,
                    "op": op.target,
                    "bytes": sum(graph.tensors[t].nbytes for t in op.outputs),
                    "decision": "recompute",
                    "recompute_seconds": op_seconds[op.index],
                    "why": "recomputed inside the backward graph from saved values",
                }
            )
        return rows


def resolve_budget(budget: int | str, fixed_bytes: int, store_all_peak: int) -> int:
    """Bytes from `40GiB`, `123` or `50%`; a share means the fixed memory (parameters, gradients,
    optimizer state, inputs) plus that share of the rest of store-all's peak."""
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            share = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"budget {budget!r}: write a share as e.g. 50%") from None
        if not 0 <= share <= 10:
            raise ValueError(f"budget {budget!r}: a share must be between 0% and 1000%")
        return fixed_bytes + int(share * (store_all_peak - fixed_bytes))
    return parse_bytes(budget)


def build_plan(
    graph: Graph,
    regions: tuple[Region, ...],
    *,
    strategy: str,
    budget_bytes: int | None,
    op_seconds: list[float],
    base_bytes: int,
    device: str,
    reason: str,
    details: dict[str, Any] | None = None,
) -> Plan:
    """Simulate `regions` and describe the plan: what stays, what is recomputed, at what cost."""
    sim = simulate(graph, regions, base_bytes=base_bytes)
    replayed = set(sim.recompute_ops)
    recomputed = sorted(
        {
            graph.ops[graph.storages[sid].allocated_at].name
            for sid in graph.saved_storages
            if graph.storages[sid].allocated_at in replayed
        }
    )
    recomputed_set = set(recomputed)
    saved = []
    for sid in graph.saved_storages:
        producer = graph.producer_op(sid)
        if producer is not None and producer.name not in recomputed_set:
            saved.append(SavedTensor(producer.name, producer.target, graph.storages[sid].nbytes))
    return Plan(
        strategy=strategy,
        budget_bytes=budget_bytes,
        regions=regions,
        predicted_peak_bytes=sim.peak_bytes,
        held_bytes=sim.held_bytes,
        recompute_flops=sum(graph.ops[i].flops for i in sim.recompute_ops),
        recompute_seconds=sum(op_seconds[i] for i in sim.recompute_ops),
        forward_flops=sum(op.flops for op in graph.forward_ops),
        device=device,
        reason=reason,
        saved=tuple(saved),
        recomputed=tuple(recomputed),
        details=details or {},
    )


def describe(plan: Plan) -> str:
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"
    return (
        f"{plan.strategy}: peak {format_bytes(plan.predicted_peak_bytes)} (budget {budget}), "
        f"held {format_bytes(plan.held_bytes)}, recompute {plan.recompute_flops_share:.0%} of "
        f"forward FLOPs, +{plan.recompute_seconds * 1e3:.2f} ms"
    )
