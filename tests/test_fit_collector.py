"""`fit` runs with Python's cyclic garbage collector paused (issue 35: a quarter of the 8B fit's
CPU time went to full collections walking the objects it keeps) and gives it back as it was."""

from __future__ import annotations

import gc

import pytest

from remat.answers.fit import fit
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
