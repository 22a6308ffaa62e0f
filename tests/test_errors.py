"""The error tree: every remat error is a `RematError` and a `ValueError`, and `exit_code` is the one
place that maps errors to the CLI's exit status."""

from __future__ import annotations

import re

import pytest

from remat.device.cost import get_profile
from remat.errors import (
    BudgetError,
    InfeasibleBudget,
    NoBlocksError,
    PlanFormatError,
    RematError,
    StatefulModuleError,
    StrategyRefused,
    TraceError,
    UnknownModelError,
    UnknownProfileError,
    UnknownStrategyError,
    exit_code,
)
from remat.units import parse_bytes

ERRORS = [
    UnknownModelError("no such model"),
    TraceError("no meta kernel", op="aten::foo", module="h.0"),
    InfeasibleBudget("too small", budget_bytes=10, min_feasible_bytes=20),
    StatefulModuleError("writes a cache", module="h.0.attn"),
    StrategyRefused("runs of blocks under LayerDrop", strategy="sqrt", budget_bytes=10),
    PlanFormatError("bad plan", field="budget_bytes"),
    NoBlocksError("no repeated blocks", strategy="sqrt"),
    UnknownStrategyError("no such strategy", name="fastest", choices=["auto", "sqrt"]),
    BudgetError("cannot read '40 GB?'"),
    UnknownProfileError("no such profile"),
]


def test_remat_error_is_a_value_error():
    assert issubclass(RematError, ValueError)
    with pytest.raises(ValueError):
        raise RematError("old callers catch ValueError")


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_is_a_remat_error(error):
    assert isinstance(error, RematError) and isinstance(error, ValueError)
    assert type(error).__doc__ and type(error).__doc__.strip()


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_exit_code(error):
    assert exit_code(error) == (3 if isinstance(error, InfeasibleBudget) else 2)


def test_exit_code_of_no_blocks_is_bad_input_not_infeasible():
    assert exit_code(NoBlocksError("x", strategy="sqrt")) == 2


def test_exit_code_of_a_subclass_follows_its_parent():
    class Tighter(InfeasibleBudget):
        pass

    assert exit_code(Tighter("x", budget_bytes=1, min_feasible_bytes=None)) == 3


@pytest.mark.parametrize(
    "error", [ValueError("plain"), RuntimeError("bug"), KeyError("k"), KeyboardInterrupt()]
)
def test_exit_code_of_anything_else_is_1(error):
    assert exit_code(error) == 1


def test_attributes():
    assert PlanFormatError("x").field is None
    assert PlanFormatError("x", field="strategy").field == "strategy"
    assert NoBlocksError("x", strategy="sqrt").strategy == "sqrt"
    e = UnknownStrategyError("x", name="fastest", choices=["auto", "sqrt"])
    assert (e.name, e.choices) == ("fastest", ("auto", "sqrt"))


@pytest.mark.parametrize("text", ["12 parsecs", "40 GB?", "", "GiB", "-1GiB"])
def test_parse_bytes_raises_budget_error_naming_the_text(text):
    with pytest.raises(
        BudgetError, match=f"cannot read {re.escape(repr(text))}.*e.g. 40GiB"
    ) as info:
        parse_bytes(text)
    assert exit_code(info.value) == 2


def test_parse_bytes_still_reads_good_sizes():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes(123) == 123


def test_get_profile_raises_unknown_profile_error_listing_known_names():
    from remat.device.cost import PROFILES

    with pytest.raises(UnknownProfileError, match="'tpu-v9'") as err:
        get_profile("tpu-v9")
    assert all(name in str(err.value) for name in PROFILES)


def test_every_error_survives_pickling_with_its_fields():
    """`remat fit`'s worker processes send a RematError to the parent by pickle; the default
    reduction calls the class with the message alone, which keyword-only fields refuse."""
    import pickle

    from remat import errors

    made = [
        errors.InfeasibleBudget("b", budget_bytes=1, min_feasible_bytes=2),
        errors.StrategyRefused("r", strategy="sqrt", budget_bytes=3),
        errors.SequenceLimitError("s", limit=1024, lever="--set block_size=N"),
        errors.TraceError("t", op="aten.mm", module="h.0", fake_tensor_failure=True),
        errors.NoBlocksError("n", strategy="full"),
        errors.UnknownStrategyError("u", name="x", choices=["full"]),
        errors.PlanFormatError("p", field="regions"),
        errors.StatefulModuleError("m", module="h.1"),
        errors.BudgetError("plain"),
    ]
    for err in made:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.args == err.args and vars(back) == vars(err)
        assert str(back) == str(err)
