"""A plan is data: which regions are checkpointed and which ops' outputs each keeps, with the cost
it predicts. It round-trips through JSON and applies to any model of the same architecture, because
it names regions by module path and ops by their stable names."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from remat.device.cost import PROFILES, op_seconds_all
from remat.errors import BudgetError, PlanFormatError
from remat.graph import Graph
from remat.prediction.schedule import Region, simulate
from remat.units import format_bytes, parse_bytes

#: How sure a plan is: a rule applied as written (`fixed`), a solver's proven optimum for its model
#: (`optimal`), or a solver's answer that fits but is not proven best (`feasible`: a time limit, a
#: tightened target after the simulation disagreed with the solver's model).
PlanStatus = Literal["fixed", "optimal", "feasible"]
#: Where a plan runs: `remat.apply` on the eager step, or remat's partitioner inside torch.compile.
PlanPath = Literal["eager", "compile"]
#: Plan JSON's `format`; 1 is every plan written before the field existed.
PLAN_FORMAT = 2
#: what `remat plan --json` writes beside the plan's own fields (the question asked, the other
#: strategies' rows, a derived share): `Plan.from_json` reads such a file as the plan it holds
ANSWER_FIELDS = ("model", "batch", "seq", "dtype", "budget", "comparison", "recompute_flops_share")
#: `Plan.held_by_module`'s key for what checkpoint's frames keep (RNG states, BatchNorm snapshots)
CHECKPOINT_FRAMES = "<checkpoint frames>"


@dataclass(frozen=True)
class SavedTensor:
    name: str  # the stable name of the op that made it
    op: str  # aten target
    bytes: int


@dataclass(frozen=True)
class Plan:
    """A strategy's answer, in the manner of scipy's `OptimizeResult`: the decision (`regions`
    for the eager path, `saved`/`recomputed` for both), what it predicts, how sure it is
    (`status`), and why (`reason`). `profile` names the cost profile the seconds are on.
    `details` holds solver-specific figures for reading (MILP gap, cut cost, traffic); nothing
    in remat branches on them."""

    strategy: str
    budget_bytes: int | None
    regions: tuple[Region, ...]
    predicted_peak_bytes: int
    held_bytes: int  # live at the end of the forward for the backward (`Simulation.held_bytes`)
    recompute_flops: int
    recompute_seconds: float
    forward_flops: int
    profile: str
    reason: str
    path: PlanPath = "eager"
    appliable: bool = True  # `remat.apply` can run it (eager plans but store_none's)
    status: PlanStatus = "fixed"
    saved: tuple[SavedTensor, ...] = ()
    recomputed: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    #: `held_bytes` by the module whose op allocated them (its path; the loss's ops: `<loss>`;
    #: what checkpoint's frames keep, RNG states and BatchNorm snapshots: `<checkpoint frames>`),
    #: for the first step's check (`remat.applying.first_step`) to name the modules that differ
    held_by_module: dict[str, int] = field(default_factory=dict)
    #: offload (docs/offload.md): the blocks whose saves of at least `offload_min_bytes` go to
    #: host memory (a compiled plan: the saved values' node names), the host memory they take,
    #: and the copy seconds no compute hides (step time)
    offload: tuple[str, ...] = ()
    offload_min_bytes: int = 0
    host_bytes: int = 0
    transfer_seconds: float = 0.0
    offload_drop_bytes: int = 0  # how much lower the peak is than the same plan's without offload
    #: a stored block that offloads only some of its storages (per tensor): block path -> their
    #: places in the order its forward first saves them (the hooks number them the same way)
    offload_saves: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: the optimizer's part of `predicted_peak_bytes` (planned with one): its state, live
    #: throughout the step, or more where the optimizer step is the peak; a step run without
    #: the optimizer (`remat.verify`'s) peaks at `predicted_peak_bytes - optimizer_bytes`
    optimizer_bytes: int = 0

    @property
    def added_seconds(self) -> float:
        """What the plan adds to a step: recompute and the copies no compute hides."""
        return self.recompute_seconds + self.transfer_seconds

    @property
    def recompute_flops_share(self) -> float:
        """Extra FLOPs as a share of the forward's (full checkpointing is about 100% of the forward,
        i.e. about 33% of a step)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def __repr__(self) -> str:
        """One line: what was chosen and what it predicts (the fields: `to_dict()`)."""
        budget = f" (budget {format_bytes(self.budget_bytes)})" if self.budget_bytes else ""
        kept = sum(len(r.keep) for r in self.regions)
        return (
            f"Plan({self.strategy}: peak {format_bytes(self.predicted_peak_bytes)}{budget}, "
            f"held {format_bytes(self.held_bytes)}, recompute "
            f"{self.recompute_flops_share:.1%} of the forward's FLOPs "
            f"(+{self.recompute_seconds * 1e3:.3g} ms on {self.profile}), "
            f"{len(self.regions)} regions, {kept} kept ops"
            + (
                f", {len(self.offload)} {'values' if self.path == 'compile' else 'blocks'} "
                f"offloaded: {format_bytes(self.host_bytes)} on the "
                f"host, +{self.transfer_seconds * 1e3:.3g} ms copies not hidden"
                if self.offload
                else ""
            )
            + f", {self.status})"
        )

    def __str__(self) -> str:
        """A few lines for a person: the repr, why, and the regions (the first few)."""
        lines = [repr(self), f"  why: {self.reason}"]
        shown = 6
        for region in self.regions[:shown]:
            modules = region.modules[0] + (
                f" .. {region.modules[-1]}" if len(region.modules) > 1 else ""
            )
            keep = f", keeps {len(region.keep)} ops" if region.keep else ", recomputed whole"
            lines.append(f"  region {modules or '<root>'}{keep}")
        if len(self.regions) > shown:
            lines.append(f"  ... {len(self.regions) - shown} more regions (plan.regions)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan `to_json` wrote (this format or format 1). `PlanFormatError` names the field
        that is missing or of the wrong kind."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"not a plan: invalid JSON ({e})", field=None) from None
        if not isinstance(d, dict):
            raise PlanFormatError("not a plan: the JSON is not an object", field=None)
        version = d.pop("format", 1)
        if version not in (1, PLAN_FORMAT):
            raise PlanFormatError(
                f"plan format {version!r} is not one this remat reads ({PLAN_FORMAT} or 1): "
                "upgrade remat or make the plan again",
                field="format",
            )
        if version == 1:  # written by remat 0.2 and before
            if "held_bytes" not in d:
                d["held_bytes"] = d.pop("retained_bytes", 0)
            d.pop("saved_bytes", None)
            d["profile"] = d.pop("device", "cpu")
            extra = d.get("details") or {}
            d.setdefault("path", extra.get("path", "eager"))
            d.setdefault("appliable", extra.get("appliable", d["path"] == "eager"))
            d.setdefault("status", "feasible")  # not recorded: it fitted, nothing more is known
        for key in ANSWER_FIELDS:  # `remat plan --json` writes the plan among these: read past
            d.pop(key, None)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanFormatError(
                f"plan field {unknown[0]!r} is not a Plan field", field=unknown[0]
            )
        regions = _field(d, "regions", list)
        for r in regions:
            if isinstance(r, dict) and r.get("keep") and "keep_keys" not in r:
                raise PlanFormatError(
                    f"plan region {r.get('modules', ['?'])[0]!r} names its kept ops by position (a "
                    "plan written by remat before 0.2, which real runs did not always honour): "
                    "make the plan again",
                    field="regions",
                )
        try:
            d["regions"] = tuple(
                Region(
                    modules=tuple(r["modules"]),
                    first_op=int(r["first_op"]),
                    last_op=int(r["last_op"]),
                    keep=tuple(r["keep"]),
                    keep_keys=tuple(tuple(k) for k in r.get("keep_keys", ())),
                    random=bool(r.get("random", True)),
                    carry_output=tuple(r.get("carry_output", ())),
                    carry_argument=str(r.get("carry_argument", "0")),
                    calls=tuple(int(n) for n in r.get("calls", ())),
                )
                for r in regions
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"plan field 'regions': {e!r}", field="regions") from None
        saved = _field(d, "saved", list, [])
        try:
            d["saved"] = tuple(SavedTensor(**s) for s in saved)
        except TypeError as e:
            raise PlanFormatError(f"plan field 'saved': {e}", field="saved") from None
        d["recomputed"] = tuple(_field(d, "recomputed", list, []))
        d["offload"] = tuple(_field(d, "offload", list, []))
        try:
            d["offload_saves"] = {
                str(k): tuple(int(i) for i in v)
                for k, v in _field(d, "offload_saves", dict, {}).items()
            }
        except (TypeError, ValueError) as e:
            raise PlanFormatError(
                f"plan field 'offload_saves': {e!r}", field="offload_saves"
            ) from None
        for name, default in (
            ("offload_min_bytes", 0),
            ("host_bytes", 0),
            ("transfer_seconds", 0.0),
            ("offload_drop_bytes", 0),
            ("optimizer_bytes", 0),
        ):
            d.setdefault(name, default)
        d.setdefault("details", {})
        d.setdefault("held_by_module", {})  # plans written before the field: totals only
        for name, kind in _SCALARS.items():
            _field(d, name, kind)
        for name, allowed in (("status", PlanStatus), ("path", PlanPath)):
            if d[name] not in get_args(allowed):
                raise PlanFormatError(
                    f"plan field {name!r} is {d[name]!r}, not one of {', '.join(get_args(allowed))}",
                    field=name,
                )
        return cls(**d)

    def explain(self, graph: Graph) -> Explanation:
        """Every activation autograd saves in store-all, with what this plan does with it, what
        recomputing it costs on the plan's device profile, and why: a list of dicts that prints
        as a table, largest first (`Explanation`)."""
        profile = PROFILES.get(self.profile, PROFILES["cpu"])
        op_seconds = op_seconds_all(graph, profile)
        if self.path == "compile":
            return Explanation(self._explain_compiled(graph, op_seconds))
        kept = {s.name for s in self.saved}
        recomputed = set(self.recomputed)
        on_host = self._offloaded_storages(graph)
        rows = []
        for sid in graph.saved_storages:
            producer = graph.producer_op(sid)
            name = producer.name if producer is not None else "<input>"
            region = next((r for r in self.regions if r.covers(producer and producer.index)), None)
            if producer is None:
                why = "a model input: it exists anyway"
            elif sid in on_host:
                why = "offloaded: copied to host memory in the forward, back before its backward op"
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
                    "decision": "offload"
                    if sid in on_host
                    else "recompute"
                    if name in recomputed
                    else "keep",
                    "recompute_seconds": op_seconds[producer.index]
                    if producer is not None
                    else 0.0,
                    "why": why,
                }
            )
        return Explanation(rows)

    def _offloaded_storages(self, graph: Graph) -> set[int]:
        """The storages this plan's offload moves to host memory on `graph`."""
        if not self.offload:
            return set()
        from remat.planning.offload import block_offload

        calls = [m for m in graph.blocks if m.path in set(self.offload)]
        offload = block_offload(
            graph, self.regions, calls, self.offload_min_bytes, False, chosen=self.offload_saves
        )
        return offload.storages(graph)

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


class Explanation(list):
    """`Plan.explain`'s rows, one dict per saved tensor (name, op, bytes, decision,
    recompute_seconds, why), as a list; printed, a table of the largest `SHOWN` with the totals
    (a list of dicts printed as a wall of text)."""

    SHOWN = 20

    def __str__(self) -> str:
        recomputed = [r for r in self if r["decision"] == "recompute"]
        again = sum(r["bytes"] for r in recomputed)
        total = sum(r["bytes"] for r in self)
        lines = [
            f"{len(self)} saved tensors: {len(recomputed)} recomputed ({format_bytes(again)}), "
            f"{len(self) - len(recomputed)} kept ({format_bytes(total - again)}); largest first"
        ]
        rows = sorted(self, key=lambda r: -r["bytes"])[: self.SHOWN]
        cells = [
            (format_bytes(r["bytes"]), r["decision"], _seconds(r["recompute_seconds"]),
             r["name"], r["why"])
            for r in rows
        ]  # fmt: skip
        head = ("bytes", "decision", "recompute", "tensor", "why")
        widths = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
        for c in [head, *cells]:
            lines.append(
                f"{c[0]:>{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]:>{widths[2]}}  "
                f"{c[3]:<{widths[3]}}  {c[4]}"
            )
        if len(self) > self.SHOWN:
            lines.append(f"... {len(self) - self.SHOWN} more (every row: list(explanation))")
        return "\n".join(lines)

    __repr__ = __str__


def _seconds(s: float) -> str:
    """Seconds as ms or us, three significant digits."""
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "strategy": str,
    "budget_bytes": (int, type(None)),
    "predicted_peak_bytes": int,
    "held_bytes": int,
    "recompute_flops": int,
    "recompute_seconds": (float, int),
    "forward_flops": int,
    "profile": str,
    "reason": str,
    "path": str,
    "appliable": bool,
    "status": str,
    "details": dict,
    "held_by_module": dict,
    "offload_min_bytes": int,
    "host_bytes": int,
    "transfer_seconds": (float, int),
    "optimizer_bytes": int,
    "offload_drop_bytes": int,
}
_MISSING = object()


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING):
    """`d[name]`, checked to be of `kind`; `PlanFormatError` naming the field otherwise."""
    if name not in d:
        if default is _MISSING:
            raise PlanFormatError(f"plan field {name!r} is missing", field=name)
        d[name] = default
    if not isinstance(d[name], kind):
        raise PlanFormatError(
            f"plan field {name!r} is {type(d[name]).__name__} {d[name]!r:.40}, not "
            f"{getattr(kind, '__name__', None) or ' or '.join(k.__name__ for k in kind)}",
            field=name,
        )
    return d[name]


#: The budget when none is given: the lowest peak whose predicted recompute is at most 10% of the
#: step's time. Always feasible (store-all qualifies), unlike a share, which can fall below the
#: memory the end of the step needs whatever is recomputed.
DEFAULT_BUDGET = "+10%"


def overhead_share(budget: int | str) -> float | None:
    """X / 100 for a budget written `+X%` (at most X% more predicted step time), else None."""
    if not (isinstance(budget, str) and budget.strip().startswith("+")):
        return None
    text = budget.strip()
    try:
        share = float(text[1:].removesuffix("%")) / 100
    except ValueError:
        raise BudgetError(f"budget {budget!r}: write a time overhead as e.g. +10%") from None
    if not text.endswith("%") or share < 0:
        raise BudgetError(f"budget {budget!r}: write a time overhead as e.g. +10%")
    return share


def describe_budget(budget: int | str) -> str:
    """What a budget as written means, in words, for the line that shows what it resolved to."""
    share = overhead_share(budget)
    if share is not None:
        return f"the lowest peak whose predicted recompute is at most {share:.0%} of the step"
    if isinstance(budget, str) and budget.strip().endswith("%"):
        return f"the fixed memory + {budget.strip()} of the rest of store-all's peak"
    return "as given"


def resolve_budget(budget: int | str, fixed_bytes: int, store_all_peak: int) -> int:
    """Bytes from `40GiB`, `123` or `50%`; a share means the fixed memory (parameters, gradients,
    optimizer state, inputs) plus that share of the rest of store-all's peak. A time overhead
    (`+10%`) needs the frontier: `Planner.budget_bytes` resolves it."""
    if overhead_share(budget) is not None:
        raise BudgetError(
            f"budget {budget!r} is a time overhead, which only the eager planner resolves "
            "(remat.Planner / remat.plan); give bytes (2GiB) or a share (50%)"
        )
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            share = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise BudgetError(f"budget {budget!r}: write a share as e.g. 50%") from None
        if not 0 <= share <= 10:
            raise BudgetError(f"budget {budget!r}: a share must be between 0% and 1000%")
        return fixed_bytes + int(share * (store_all_peak - fixed_bytes))
    nbytes = parse_bytes(budget)
    try:
        number = float(budget.strip()) if isinstance(budget, str) else None
    except ValueError:
        number = None  # written with a unit
    if nbytes < 1:
        hint = f"; did you mean {number:.0%}?" if number is not None and 0 < number <= 1 else ""
        raise BudgetError(
            f"budget {budget!r} is {nbytes} bytes: give a positive size (e.g. 2GiB) or a share of "
            f"store-all's peak (e.g. 50%){hint}"
        )
    if number is not None and nbytes < 1024:
        # a bare number this small is a share written without its %, not a step's memory
        share = f" did you mean {budget.strip()}%?" if number <= 1000 else ""
        raise BudgetError(
            f"budget {budget!r} is {nbytes} bytes, less than any training step holds:{share} "
            "Write a share with its % (50%) and a size with its unit (50MiB)"
        )
    return nbytes


def recompute_seconds(
    op_seconds: Sequence[float], recompute_ops: Iterable[int], overhead_seconds: float
) -> float:
    """A plan's predicted recompute time: its replays' ops, in replay order, and what
    checkpointing itself costs."""
    return sum(op_seconds[i] for i in recompute_ops) + overhead_seconds


def build_plan(
    graph: Graph,
    regions: tuple[Region, ...],
    *,
    strategy: str,
    budget_bytes: int | None,
    op_seconds: list[float],
    base_bytes: int,
    profile: str,
    reason: str,
    status: PlanStatus = "fixed",
    appliable: bool = True,
    details: dict[str, Any] | None = None,
    overhead_seconds: float = 0.0,
    offload: Any = None,
) -> Plan:
    """Simulate `regions` and describe the plan: what stays, what is recomputed, at what cost.
    `recompute_seconds` is the recomputed ops' time plus `overhead_seconds`, what checkpointing
    itself costs (`remat.device.cost.checkpoint_overhead_seconds`). `offload`, a
    `remat.planning.offload.OffloadChoice`, puts its saves on the host."""
    sim = simulate(
        graph, regions, base_bytes=base_bytes, offload=offload.offload if offload else None
    )
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
    end_of_forward = sim.schedule.index(("op", len(graph.forward_ops) - 1))
    held_by_module: dict[str, int] = {}
    for sid, death in sim.deaths.items():
        op = graph.ops[graph.storages[sid].allocated_at]
        if death > end_of_forward and op.phase == "forward":
            held_by_module[op.module] = (
                held_by_module.get(op.module, 0) + graph.storages[sid].nbytes
            )
    frames = sim.held_bytes - sum(held_by_module.values())
    if frames:
        held_by_module[CHECKPOINT_FRAMES] = frames
    return Plan(
        strategy=strategy,
        budget_bytes=budget_bytes,
        regions=regions,
        predicted_peak_bytes=sim.peak_bytes,
        held_bytes=sim.held_bytes,
        recompute_flops=sum(graph.ops[i].flops for i in sim.recompute_ops),
        recompute_seconds=recompute_seconds(op_seconds, sim.recompute_ops, overhead_seconds),
        forward_flops=sum(op.flops for op in graph.forward_ops),
        profile=profile,
        reason=reason,
        status=status,
        appliable=appliable,
        saved=tuple(saved),
        recomputed=tuple(recomputed),
        details=details or {},
        held_by_module=held_by_module,
        offload=offload.blocks if offload else (),
        offload_min_bytes=offload.min_bytes if offload else 0,
        offload_saves=dict(offload.chosen) if offload else {},
        host_bytes=offload.offload.host_bytes(graph) if offload else 0,
        transfer_seconds=offload.exposed_seconds if offload else 0.0,
        offload_drop_bytes=simulate(graph, regions, base_bytes=base_bytes).peak_bytes
        - sim.peak_bytes
        if offload
        else 0,
    )
