"""The simulated peak of a step with the first k of a list of regions checkpointed, for every k,
from one analysis instead of one simulation per k (`first_k`'s search over its block count).

Regions that keep nothing replay the same way whichever others are checkpointed: a region's
replay (its trigger, early stop, holders, frame) depends on its own saves only
(`schedule.analyse_regions`). So the schedule with the first k regions is the schedule with all
of them less the replays of the others, and every position of the first is a position of the
second, in the same order. On the schedule of all regions, a storage's lives with the first k
checkpointed (`schedule.storage_life`, the rule `simulate` applies) change only as k passes a
region that makes, saves or frames it; the step's timeline with k regions is the sum of those
lives at the positions the k regions' schedule has. Stepping k adds region k's frame and
replay and re-lives only the storages region k touches, and the peak is a maximum over an
array: the same integer `simulate(graph, regions[:k]).peak_bytes` gives, for each k
(tests/test_prefix_peaks.py compares them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.device.targets import ops_scratch_bytes
from remat.graph import Graph
from remat.prediction.schedule import (
    Life,
    Region,
    RegionReplay,
    Schedule,
    analyse_regions,
    build_schedule,
    frame_lives,
    recompute_ops,
    rng_state_bytes,
    save_region,
    save_release,
    storage_life,
)


@dataclass(frozen=True)
class Prefixes:
    """A step with the first k of some regions checkpointed, for every k: `peaks[k]` is
    `simulate(graph, regions[:k]).peak_bytes` with no bytes before the step, `replays` each
    region's replay (the same whichever others are checkpointed)."""

    peaks: tuple[int, ...]
    replays: tuple[RegionReplay, ...]

    def recompute_ops(self, k: int) -> tuple[int, ...]:
        """`simulate(graph, regions[:k]).recompute_ops`."""
        return recompute_ops(self.replays[:k])


def prefixes(graph: Graph, regions: Sequence[Region]) -> Prefixes | None:
    """The step with each prefix of `regions` checkpointed, kept per graph and regions. None where
    stepping does not give the same answer: a region that keeps ops (its kept outputs' lives read
    positions next to its replay), or two regions whose replays share a trigger (the schedule
    then runs only one of them); the caller simulates each prefix."""
    kept: dict[tuple[Region, ...], Prefixes | None] = graph.derived(
        "prefixes", dict, ops_scratch_bytes(graph), graph.ops, graph.storages
    )
    key = tuple(regions)
    if key not in kept:
        kept[key] = _prefixes(graph, key)
    return kept[key]


def _prefixes(graph: Graph, regions: tuple[Region, ...]) -> Prefixes | None:
    if any(r.keep for r in regions):
        return None
    analysis = analyse_regions(graph, regions)
    triggers = [rep.trigger for rep in analysis.replays if rep.trigger is not None]
    if len(set(triggers)) != len(triggers):
        return None
    full = build_schedule(graph, analysis)
    end = len(graph.ops)
    positions = len(full.order)
    region_of_op = analysis.region_of_op

    # Which regions each storage's lives depend on: the one its op is in, those that save it,
    # and those whose frame holds it; and autograd's hold of it by each save's region (-1: none).
    touched: dict[int, set[int]] = defaultdict(set)
    holds: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for sid, region, released in _save_regions(graph, region_of_op):
        holds[sid].append((region, released))
        if region != -1:
            touched[sid].add(region)
    for r, rep in enumerate(analysis.replays):
        for sid in rep.frame_inputs:
            touched[sid].add(r)
    made = [s for s in graph.storages.values() if s.allocated_at is not None]
    for s in made:
        if region_of_op[s.allocated_at] != -1:
            touched[s.id].add(region_of_op[s.allocated_at])
    by_region: dict[int, list[int]] = defaultdict(list)
    for sid, found in touched.items():
        for r in found:
            by_region[r].append(sid)

    replay_position: dict[int, int] = {}
    schedule = Schedule(full.order, full.position_of_op, replay_position)  # the first k's replays
    storages = graph.storages

    def lives_of(sid: int, k: int) -> list[Life]:
        """Storage `sid`'s lives with the first k regions checkpointed, on the full schedule."""
        s = storages[sid]
        held = max((t for r, t in holds.get(sid, ()) if r == -1 or r >= k), default=-1)
        for r in touched.get(sid, ()):
            if r < k and sid in analysis.replays[r].frame_inputs:
                held = max(held, analysis.replays[r].frame_until)
        region = region_of_op[s.allocated_at]
        return storage_life(s, held, region if region < k else -1, analysis, schedule, end)[1]

    delta = np.zeros(positions + 2, dtype=np.int64)

    def add(lives: list[Life], sign: int) -> None:
        for first, last, nbytes in lives:
            delta[first] += sign * nbytes
            delta[min(last, positions) + 1] -= sign * nbytes

    for s in made:
        add(lives_of(s.id, 0), 1)
    scratch = ops_scratch_bytes(graph)
    scratch_at = np.array([scratch[i] for _, i in full.order], dtype=np.int64)
    present = np.array([kind == "op" for kind, _ in full.order], dtype=bool)
    rng_bytes = rng_state_bytes(graph)
    peaks = []
    for k in range(len(regions) + 1):
        if k:
            rep = analysis.replays[k - 1]
            changed = [sid for sid in by_region[k - 1] if storages[sid].allocated_at is not None]
            for sid in changed:
                add(lives_of(sid, k - 1), -1)
            for i in rep.ops:
                replay_position[i] = full.replay_position[i]
                present[full.replay_position[i]] = True
            for sid in changed:
                add(lives_of(sid, k), 1)
            add(frame_lives(rep, schedule, rng_bytes), 1)
        timeline = np.cumsum(delta[:positions]) + scratch_at
        peaks.append(int(timeline[present].max()))
    return Prefixes(tuple(peaks), analysis.replays)


def _save_regions(graph: Graph, region_of_op: Sequence[int]) -> list[tuple[int, int, int]]:
    """(storage, region of the node that saved it or -1, when autograd lets go of it) per save of
    a storage made during the step, read as `analyse_regions` reads them."""
    return [
        (sv.storage, save_region(graph, sv, region_of_op), save_release(graph, sv))
        for sv in graph.saved
        if graph.storages[sv.storage].allocated_at is not None
    ]
