"""Results a person can read: every public result type has a one-line repr that leads with the
answer (a plan's repr was a 60 KB dataclass dump), and `auto` says in one log line what it
installed, silenceable through the `remat` logger."""

from __future__ import annotations

import logging

import pytest

import remat
from remat import models


@pytest.fixture(scope="module")
def planned():
    model, inputs = models.build("gpt2", tiny=True, device="cpu", batch=8, seq=128, n_layer=4)
    graph = remat.trace(model, *inputs)
    return model, inputs, graph, remat.Planner(graph)


def test_result_reprs_are_one_short_line_that_leads_with_the_answer(planned):
    model, inputs, graph, planner = planned
    plan = planner.plan("90%", "auto")
    remat.apply(model, plan)
    results = {
        "Plan(auto (": plan,
        "Verification(ok=True": remat.verify(model, *inputs),
        "Frontier(": planner.pareto(),
        "MemoryEstimate(peak ": remat.estimate(graph),
        "Comparison(store_all: peak ": planner.compare("90%")[0],
    }
    remat.remove(model)
    for start, result in results.items():
        text = repr(result)
        assert text.startswith(start), text
        assert "\n" not in text and len(text) < 400, text
    assert len(str(plan).splitlines()) <= 10
    assert "peak" in repr(plan) and "budget" in repr(plan)


def test_fit_report_repr_says_whether_it_fits(planned):
    from remat.answers.fit import fit
    from remat.device.gpus import get_gpu

    def build(batch, seq, device="meta"):
        return models.build("gpt2", batch=batch, seq=seq, tiny=True, device=device)

    report = fit(build, model="gpt2", batch=1, seq=64, gpu=get_gpu("h100"))
    text = repr(report)
    assert text.startswith("FitReport(gpt2 on ") and "fit" in text and len(text) < 600, text


def test_auto_logs_one_line_on_the_remat_logger_and_can_be_silenced(planned, caplog):
    model, inputs, _, _ = planned
    logger = logging.getLogger("remat")
    logger.addHandler(caplog.handler)
    try:
        remat.auto(model, *inputs, budget="90%")
        lines = [r.getMessage() for r in caplog.records if r.name == "remat"]
        assert len(lines) == 1 and lines[0].startswith("remat: installed auto (")
        assert "predicted peak" in lines[0]
        caplog.clear()
        logger.setLevel(logging.WARNING)
        remat.auto(model, *inputs, budget="90%")
        assert not [r for r in caplog.records if r.name == "remat"]
    finally:
        logger.setLevel(logging.INFO)
        logger.removeHandler(caplog.handler)
        remat.remove(model)


def test_auto_is_never_fixed_and_the_solver_speaks_plainly(planned):
    _, _, _, planner = planned
    for budget in ("100%", "90%", "1TiB"):
        plan = planner.plan(budget, "auto")
        assert plan.status in ("optimal", "feasible"), (budget, plan.status)
    milp = planner.plan("90%", "milp")
    assert "HiGHS proved" not in milp.reason and "proved optimal by the MILP solver" in milp.reason
    assert " ms " in milp.reason or " us " in milp.reason  # a reader's unit, not 0.000395 s


def test_the_glossary_defines_the_words_the_answers_use():
    import re
    from pathlib import Path

    glossary = (Path(__file__).parent.parent / "docs" / "glossary.md").read_text().lower()
    terms = re.findall(r"\*\*(.+?)\*\*", glossary)  # each entry's defined words
    for word in ("held", "kept for backward", "reserved", "usable", "within noise", "noisy",
                 "plan status", "kernel scratch", "random control flow", "budget", "profile",
                 "in flight", "tightest rank", "layout"):  # fmt: skip
        assert any(word in term for term in terms), word
