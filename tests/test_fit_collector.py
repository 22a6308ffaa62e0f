"""`fit` runs with Python's cyclic garbage collector paused (issue 35: a quarter of the 8B fit's
CPU time went to full collections walking the objects it keeps) and gives it back as it was,
with what it made moved to the oldest generation rather than walked by the next young collection
(1.5 s at the end of the 70B `--shard 32` fit); so do the commands that only analyse."""

from __future__ import annotations

import gc
import weakref

import pytest

import remat.answers.cli as cli
from remat.answers.fit import fit
from remat.collector import collector_paused
from remat.device.gpus import get_gpu
from remat.errors import RematError


def _fit_that_stops_at_its_first_build(seen: list[bool]) -> None:
    def build(batch: int, seq: int):
        seen.append(gc.isenabled())
        raise RematError("stopped at the first build")

    with pytest.raises(RematError, match="stopped"):
        fit(build, model="x", batch=1, seq=8, gpu=get_gpu("h100"))


def test_fit_pauses_the_collector_and_restores_it_even_when_it_fails():
    seen: list[bool] = []
    assert gc.isenabled()
    _fit_that_stops_at_its_first_build(seen)
    assert seen == [False]
    assert gc.isenabled()


def test_fit_leaves_a_collector_turned_off_by_its_caller_off():
    seen: list[bool] = []
    gc.disable()
    try:
        _fit_that_stops_at_its_first_build(seen)
        assert seen == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_what_a_paused_block_made_skips_the_young_generations_and_its_cycles_are_still_freed():
    gc.collect()
    with collector_paused():
        kept = [[k] for k in range(50_000)]  # tracked containers, as a fit's records
        cycle = _Cycle()
        gone = weakref.ref(cycle)
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_count()[0] < 700  # not 50,000 young objects for the next collection to walk
    assert gc.get_freeze_count() == 0  # nothing left out of collections for good
    assert gc.is_tracked(kept[-1])
    gc.collect()
    assert gone() is cycle  # reachable: kept
    del cycle
    assert gone() is not None  # a cycle: reference counting alone does not free it
    gc.collect()
    assert gone() is None  # the next full collection does


@pytest.mark.parametrize("command", ["estimate", "bench"])
def test_the_cli_pauses_the_collector_for_analyses_only(command, monkeypatch):
    seen: list[bool] = []

    def command_run(args, console) -> int:
        seen.append(gc.isenabled())
        return 0

    monkeypatch.setattr(cli, f"cmd_{command}", command_run)
    assert cli.main([command, "--model", "gpt2-tiny"]) == 0
    assert seen == [command != "estimate"]
    assert gc.isenabled()
