"""Where the cost model and the machine disagree, the machine wins: time the best few plans that
fit on the real model for a few steps and keep the fastest, as inductor autotunes its kernels.

The planner ranks plans by predicted recompute time on a cost profile (a roofline plus
checkpointing's own host cost). On a small model or a busy CPU the ranking can be wrong by more
than the plans differ: a MILP mix of selective regions predicted cheapest can run slower than
`chain_dp`'s few whole-block segments, whose per-op policy cost is nil. `tune` takes the
candidates (every appliable plan that fits the budget, least predicted time first on a profile
whose checkpointing overheads were measured on this device, distinct regions only, at most
`candidates`), times them in interleaved rounds (each round one step of
every candidate, applied just before and removed just after, starting one later each round; a
warmup step each in the first), and keeps the one of least median step time; a tie goes to the
earlier, the cost model's pick. Results are cached per model (its class and parameter shapes),
input shapes, budget, profile, device and versions: for the process, and on disk (a JSON file per
result under `$REMAT_CACHE_DIR`, by default `~/.cache/remat/applying/tune/`), so that the next run of a
training script applies the same plan without timing again, as inductor keeps its autotuning.
Deleting the file (the log names it) times again; `REMAT_CACHE_DIR=off` keeps nothing on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from remat.applying.eager import apply, remove
from remat.device.cost import PROFILES, DeviceProfile
from remat.errors import PlanFormatError, RematError, warn
from remat.measuring.calibrate import calibrate_rates, checkpoint_overheads
from remat.measuring.measure import time_steps
from remat.planning.planner import Planner
from remat.planning.plans import Plan
from remat.planning.strategies import available
from remat.units import format_ms

#: A step timer: (model with a plan installed, inputs, kwargs) -> seconds of one training step.
Timer = Callable[[nn.Module, tuple, dict[str, Any]], float]


@dataclass(frozen=True)
class Tuning:
    """What `tune` timed and chose: `chosen` (its reason says so), each candidate's median step
    seconds by strategy, in the order tried, the rounds, and whether this came from the cache
    (`cache_file`: where it is kept on disk, None when nothing is)."""

    chosen: Plan
    seconds: dict[str, float]
    rounds: int
    cached: bool = False
    cache_file: Path | None = None

    def __repr__(self) -> str:
        timed = ", ".join(f"{name} {format_ms(s)}" for name, s in self.seconds.items())
        return (
            f"Tuning({self.chosen.strategy} fastest of {len(self.seconds)} in {self.rounds} "
            f"rounds: {timed}{f'; cached in {self.cache_file}' if self.cached else ''})"
        )


_CACHE: dict[tuple[Any, ...], Tuning] = {}
_OVERHEADS: dict[str, tuple[float, float]] = {}
#: The roofline's rates measured on the CPU (`calibrate_rates`), by `rates_key`; None: the
#: shipped profile's (tests pin that, so that their plans do not depend on the machine).
_RATES: dict[tuple, dict[str, Any] | None] = {}


def measured_profile(profile: DeviceProfile, device: torch.device) -> DeviceProfile:
    """What untuned `auto` ranks plans with on the model's device: `profile` with checkpointing's
    host cost measured there (`with_measured_overheads`), and, where `profile` is the shipped `cpu`
    one and the model runs on the CPU, the roofline's rates measured too (`calibrate_rates`:
    matmul, vector, transcendental, bandwidth and SDPA; ~1 s once a machine, kept on disk under
    `$REMAT_CACHE_DIR/profile` and for the process). The shipped `cpu` figures are placeholders
    that price a matmul 1.6x dear against GPT-2's layer norms, adds and GELU and its attention
    1.7x cheap, on this project's VM, so that auto recomputed the wrong ops (docs/benchmarks.md,
    issue 38). A GPU keeps its datasheet rates: the calibration's cache-resident vector loop is
    launch-bound there. A profile given as a `DeviceProfile` of other rates is kept as given."""
    profile = with_measured_overheads(profile, device)
    shipped = PROFILES["cpu"]
    rates = (profile.peak_flops, profile.vector_flops, profile.bandwidth)
    if torch.device(device).type != "cpu" or rates != (
        shipped.peak_flops,
        shipped.vector_flops,
        shipped.bandwidth,
    ):
        return profile
    key = rates_key()
    if key not in _RATES:
        _RATES[key] = _measured_rates(key)
    measured = _RATES[key]
    return profile if measured is None else replace(profile, **measured)


def rates_key() -> tuple:
    """The CPU the rates were measured on, with its intra-op threads, and the torch running."""
    return (
        f"cpu:{platform.machine()}:{platform.processor()}:{os.cpu_count()}",
        torch.get_num_threads(),
        torch.__version__,
    )


def _measured_rates(key: tuple) -> dict[str, Any]:
    """The rates kept on disk under `key`, else measured now and kept."""
    where = cache_dir()
    path = None
    if where is not None:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
        path = where.parent / "profile" / f"cpu-{digest}.json"
        try:
            record = json.loads(path.read_text())
            if record.get("key") == repr(key):
                rates = record["rates"]
                return {
                    **{str(k): float(v) for k, v in rates.items() if k != "element_ops"},
                    "element_ops": tuple((str(k), float(v)) for k, v in rates["element_ops"]),
                }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # none kept, or not one this remat wrote: measured again
    rates = calibrate_rates(torch.device("cpu"))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": repr(key), "rates": rates}, indent=1))
            tmp.replace(path)
        except OSError as err:
            warn(f"remat: could not keep the measured CPU rates in {path} ({err})")
    return rates


def with_measured_overheads(profile: DeviceProfile, device: torch.device) -> DeviceProfile:
    """`profile` with checkpointing's own host cost (`region_seconds`, `policy_op_seconds`)
    measured on `device` where the profile has none (the shipped ones: their rooflines have no
    launch cost), so that plans are ranked with it; measured once per device and process
    (`remat.measuring.calibrate.checkpoint_overheads`, well under a second on a 2-core CPU)."""
    if profile.region_seconds or profile.policy_op_seconds:
        return profile
    key = str(device)
    if key not in _OVERHEADS:
        _OVERHEADS[key] = checkpoint_overheads(torch.device(device))
    region, per_op = _OVERHEADS[key]
    return replace(profile, region_seconds=region, policy_op_seconds=per_op)


def describes(profile: DeviceProfile, device: torch.device) -> bool:
    """Whether `profile` is one of the device the model runs on (the `cpu` profile for a model on
    the CPU, a GPU's for one on CUDA), so that overheads measured there belong to it; planning
    for an H100 on a laptop measures nothing."""
    on_cpu = profile.name.split(" ")[0] == "cpu"
    return on_cpu == (device.type == "cpu")


def candidate_plans(planner: Planner, budget_bytes: int, candidates: int = 4) -> list[Plan]:
    """Every appliable plan of every strategy that fits `budget_bytes`, least predicted recompute
    first, one per distinct set of regions, at most `candidates`."""
    fitting = []
    for strategy in available("eager"):
        if strategy.name == "auto" or not strategy.appliable:
            continue
        try:
            p = planner.solve(strategy, budget_bytes)  # solved once: auto's own answers
        except RematError:  # refused or infeasible here: the others still answer
            continue
        if p.appliable and p.predicted_peak_bytes <= budget_bytes:
            fitting.append(p)
    fitting.sort(key=lambda p: (p.recompute_seconds, p.predicted_peak_bytes))
    out: list[Plan] = []
    seen: set[tuple] = set()
    for p in fitting:
        key = tuple((r.modules, r.keep) for r in p.regions)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out[:candidates]


def tune(
    model: nn.Module,
    *inputs: Any,
    planner: Planner,
    budget_bytes: int,
    candidates: int = 4,
    rounds: int = 5,
    timer: Timer | None = None,
    **kwargs: Any,
) -> Tuning:
    """The fastest of `candidate_plans` on `model` (real tensors), by `rounds` interleaved rounds
    of one step each (`timer`: seconds of one step of the model as it is installed; default a
    real training step, `remat.measuring.measure.time_steps`): the cost model's pick (the first) unless
    another was faster than it in every round (then the one of least median of those), so that
    a noisy machine does not overrule the model by chance (with 5 rounds, one other candidate of
    equal speed wins every round 1 time in 32). Raises `InfeasibleBudget` (through the planner)
    when no plan fits."""
    key = tuning_key(model, inputs, kwargs, budget_bytes, planner.profile.name, candidates)
    kept = cached(key)
    if kept is not None:
        return kept
    plans = candidate_plans(planner, budget_bytes, candidates)
    if not plans:
        planner.plan(budget_bytes, "auto")  # raises InfeasibleBudget, naming the least that fits
    timer = timer or _time_one_step
    times: list[list[float]] = [[] for _ in plans]
    for r in range(rounds):
        for k in range(len(plans)):
            i = (r + k) % len(plans)
            apply(model, plans[i])
            try:
                if r == 0:
                    timer(model, inputs, kwargs)  # warmup: allocator, lazy buffers
                times[i].append(timer(model, inputs, kwargs))
            finally:
                remove(model)
    return keep(key, fastest_of(plans, times, "rounds"))


def tuning_key(
    model: nn.Module,
    inputs: tuple,
    kwargs: dict[str, Any],
    budget_bytes: int,
    profile_name: str,
    candidates: int,
) -> tuple:
    """What a tuning result is kept under: the model (its class and parameter shapes), input
    shapes, budget, profile, number of candidates, device and torch version."""
    return (
        type(model).__qualname__,
        tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()),
        _shapes((inputs, kwargs)),
        budget_bytes,
        profile_name,
        candidates,
        _device_name(model),
        torch.__version__,
    )


def cached(key: tuple) -> Tuning | None:
    """The result kept under `key`, from this process or from disk (`cached` is True), or None."""
    if key in _CACHE:
        return replace(_CACHE[key], cached=True)
    cache_file = _cache_file(key)
    if cache_file is not None and cache_file.exists():
        kept = _read(cache_file)  # cached=True already
        if kept is not None:
            _CACHE[key] = kept
            return kept
    return None


def keep(key: tuple, result: Tuning) -> Tuning:
    """Keep `result` under `key`, for this process and on disk (where `cache_dir` allows);
    returns it with its `cache_file`."""
    cache_file = _cache_file(key)
    result = replace(result, cache_file=cache_file)
    _CACHE[key] = result
    if cache_file is not None:
        _write(cache_file, key, result)
    return result


def fastest_of(plans: list[Plan], times: list[list[float]], where: str) -> Tuning:
    """The noise rule: `plans[0]` (the cost model's pick) unless another was faster than it in
    every round (`times[i][r]`: plan i's step seconds in round r), then the one of least median
    of those; a tie goes to the earlier. With 5 rounds, another plan of equal speed wins every
    round 1 time in 32. `where` says what the rounds were, for the reason."""
    rounds = min(len(t) for t in times)
    medians = [statistics.median(t) for t in times]
    # Noise must not overrule the cost model: another plan replaces its pick (the first) only
    # when it was faster in every round, each round's steps run back to back.
    beat = [i for i in range(len(plans)) if i == 0 or all(map(float.__lt__, times[i], times[0]))]
    best = min(beat, key=lambda i: (medians[i], i))
    seconds = {p.strategy: m for p, m in zip(plans, medians, strict=True)}
    others = ", ".join(
        f"{p.strategy} {format_ms(m)}"
        for i, (p, m) in enumerate(zip(plans, medians, strict=True))
        if i != best
    )
    name = plans[best].strategy.removeprefix("auto (").removesuffix(")")
    verdict = (
        "the cost model's pick, which no other beat in every round"
        if best == 0
        else "faster than the cost model's pick in every round"
    )
    chosen = replace(
        plans[best],
        strategy=f"auto ({name}, tuned)",
        status="feasible",
        reason=f"fastest measured of {len(plans)} plans that fit, {verdict} "
        f"({format_ms(medians[best])} a step, median of {rounds} {where}"
        + (f"; {others}" if others else "")
        + f"): {plans[best].reason}",
    )
    return Tuning(chosen=chosen, seconds=seconds, rounds=rounds)


def cache_dir() -> Path | None:
    """Where tuned plans are kept: `$REMAT_CACHE_DIR/tune`, by default under `$XDG_CACHE_HOME`
    (`~/.cache`) `/remat/tune`; None when `REMAT_CACHE_DIR` is `off`."""
    root = os.environ.get("REMAT_CACHE_DIR")
    if root is not None and root.lower() in ("off", "0", "none", ""):
        return None
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "remat"
    return Path(root) / "tune"


def _cache_file(key: tuple) -> Path | None:
    where = cache_dir()
    if where is None:
        return None
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return where / f"{key[0]}-{digest}.json"


def _write(path: Path, key: tuple, result: Tuning) -> None:
    """Keep a result on disk; a cache that cannot be written is said (a warning), not an error."""
    record = {
        "key": repr(key),
        "chosen": result.chosen.to_dict(),
        "seconds": result.seconds,
        "rounds": result.rounds,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)  # atomic: ranks tuning at once never read half a file
    except OSError as err:
        warn(f"remat: could not keep the tuned plan in {path} ({err}); set REMAT_CACHE_DIR")


def _read(path: Path) -> Tuning | None:
    """A result kept on disk, or None (said) when the file is not one this remat wrote."""
    try:
        record = json.loads(path.read_text())
        chosen = Plan.from_json(json.dumps(record["chosen"]))
        return Tuning(
            chosen=chosen,
            seconds={str(k): float(v) for k, v in record["seconds"].items()},
            rounds=int(record["rounds"]),
            cached=True,
            cache_file=path,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PlanFormatError) as err:
        warn(f"remat: ignoring the tuned-plan cache file {path} ({err}); timing again")
        return None


def _device_name(model: nn.Module) -> str:
    """The device the model runs on, as precisely as torch names it: timings on one GPU or CPU
    model say nothing about another."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{platform.processor()}:{os.cpu_count()}"


def _shapes(tree: Any) -> tuple:
    """Tensors by shape and dtype, functions (a `loss_fn`) by name, not by their address, which
    differs in every process; anything else by its repr."""
    return tuple(
        (tuple(t.shape), t.dtype)
        if isinstance(t, torch.Tensor)
        else f"{t.__module__}.{t.__qualname__}"
        if callable(t) and hasattr(t, "__qualname__")
        else repr(t)
        for t in pytree.tree_leaves(tree)
    )


def _time_one_step(model: nn.Module, inputs: tuple, kwargs: dict[str, Any]) -> float:
    return time_steps(model, *inputs, steps=1, **kwargs)[0]
