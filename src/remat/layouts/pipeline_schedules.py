"""Pipeline schedules: each rank's forwards and backwards in the order torch's own schedule
classes run them (`pipeline_order`), and the micro-batches each stage holds in flight over it
(`in_flight`).

What a rank holds at once comes from the schedule, not the model: GPipe runs every micro-batch's
forward before the first backward, so each stage holds all `n`; 1F1B holds `min(n, p - i)` on
stage `i`; interleaved 1F1B holds what its per-rank order says. The counts here are read off
torch's own action orders (`pipeline_order`), never re-derived.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

from remat.errors import RematError

#: Schedule names and torch's classes; a class with several stages per rank is interleaved.
SCHEDULES: dict[str, type] = {
    "gpipe": torch_schedules.ScheduleGPipe,
    "1f1b": torch_schedules.Schedule1F1B,
    "interleaved-1f1b": torch_schedules.ScheduleInterleaved1F1B,
}
_FORWARD = torch_schedules._ComputationType.FORWARD
_BACKWARD = torch_schedules._ComputationType.FULL_BACKWARD


@dataclass(frozen=True)
class Action:
    """One computation of torch's schedule: a forward ("F") or backward ("B") of micro-batch
    `microbatch` on stage `stage`."""

    stage: int
    kind: str
    microbatch: int


def _schedule_class(schedule: str) -> type:
    if schedule not in SCHEDULES:
        raise RematError(f"unknown pipeline schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def pipeline_order(
    schedule: str, stages: int, microbatches: int, ranks: int | None = None
) -> dict[int, list[Action]]:
    """Each rank's forwards and backwards in the order torch's schedule class runs them: its
    `pipeline_order`, built without a process group (the classes only read the stages' count and
    placement). `ranks` defaults to `stages`; interleaved schedules place stage `s` on rank
    `s % ranks`, as torch's loop-style mapping does. Built once per arguments (`_order`): the
    searches over micro-batch counts ask each count again for every strategy."""
    ranks = stages if ranks is None else ranks
    return {rank: list(actions) for rank, actions in _order(schedule, stages, microbatches, ranks)}


@functools.lru_cache(maxsize=256)
def _order(
    schedule: str, stages: int, microbatches: int, ranks: int
) -> tuple[tuple[int, tuple[Action, ...]], ...]:
    cls = _schedule_class(schedule)
    interleaved = issubclass(cls, torch_schedules.PipelineScheduleMulti)
    if stages % ranks or (stages != ranks and not interleaved):
        raise RematError(
            f"schedule {schedule!r} runs {'a whole number of' if interleaved else 'one'} stage(s) "
            f"per rank: {stages} stages on {ranks} ranks do not fit"
        )
    if interleaved:
        placed: Any = [
            types.SimpleNamespace(num_stages=stages, group_size=ranks, group_rank=0, stage_index=s)
            for s in range(0, stages, ranks)
        ]
    else:
        placed = types.SimpleNamespace(num_stages=stages)
    try:
        order = cls(placed, microbatches).pipeline_order
    except ValueError as e:  # torch's own checks: 1F1B needs n >= p, interleaving whole rounds
        raise RematError(f"schedule {schedule!r} with {microbatches} micro-batches: {e}") from None
    return tuple(
        (
            rank,
            tuple(
                Action(
                    a.stage_index,
                    "F" if a.computation_type == _FORWARD else "B",
                    a.microbatch_index,
                )
                for a in actions
                if a is not None and a.computation_type in (_FORWARD, _BACKWARD)
            ),
        )
        for rank, actions in order.items()
    )


def in_flight(
    schedule: str, stages: int, microbatches: int, ranks: int | None = None
) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward has run and whose backward has not, over
    torch's order: GPipe `n` on every stage, 1F1B `min(n, p - i)` on stage `i`. (Counted, not
    matched by index: torch's 1F1B order numbers the last rank's micro-batches from 1.)"""
    most = [0] * stages
    for actions in pipeline_order(schedule, stages, microbatches, ranks).values():
        now = [0] * stages
        for a in actions:
            now[a.stage] += 1 if a.kind == "F" else -1
            most[a.stage] = max(most[a.stage], now[a.stage])
    return tuple(most)
