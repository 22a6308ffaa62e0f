"""Realise a `Plan` on a live `nn.Module` with PyTorch's own mechanisms, and check it was.

Each region becomes `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around the module
(or run of consecutive blocks) it names, called with whatever arguments the model passes (positional,
keyword-only as diffusers calls its blocks, non-tensors) and returning whatever the block returns
(a tensor, tuple, dict, dataclass). A run of blocks is entered through its first block's call and
runs the later ones itself, each with the first one's arguments but the one the trace saw carry the
previous block's output (`Region.carry_argument`), taken from where the trace saw the model take it
(`Region.carry_output`: `h = block(hidden_states=h)[0]`); the later blocks' own calls get the run's
output back. The planner joins only blocks called alike (`remat.tracing.calls`), so a run never
calls a block with arguments the model would not.

A region that keeps some ops gets a selective-checkpoint policy
(`create_selective_checkpoint_contexts`) that marks exactly those ops MUST_SAVE. Ops are
found by a stable key, (module path, aten op, occurrence of that op in that module within the
region's call), read from a module stack that forward hooks keep: a real run that issues a few
ops the trace did not (or the other way round) still keeps the planned ones. Every forward counts
what it kept; a region that missed some warns once, and `verify(model)` reports them all.
A region that draws no random numbers does not keep the RNG state, and the step runs with
key/value caching off (`remat.tracing.caches`), as the trace did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat.applying.offload import OffloadingCache
from remat.applying.offload import install as install_offload
from remat.errors import RematError, warn
from remat.measuring.measure import measure
from remat.planning.plans import Plan
from remat.prediction.schedule import OpKey, Region, key_target
from remat.tracing.caches import CachesOff
from remat.tracing.calls import argument, pick, with_argument
from remat.units import format_bytes

_APPLIED = "_remat_applied"


@dataclass
class RegionCheck:
    """What one region's policy kept in the latest forward, against what the plan keeps."""

    modules: tuple[str, ...]
    expected: frozenset[OpKey]
    matched: frozenset[OpKey] = frozenset()  # in the latest finished forward
    forwards: int = 0
    running: set[OpKey] = field(default_factory=set, repr=False)  # in the forward under way

    @property
    def missing(self) -> list[OpKey]:
        return sorted(self.expected - self.matched)


@dataclass
class _Applied:
    """Everything `apply` changed on a model, so that `remove` undoes exactly that. It and every
    callable `apply` installs are plain objects of this module's classes, not closures, so that a
    planned model survives `copy.deepcopy` (each copy's regions run and remove its own blocks),
    `pickle`, `torch.save` and multiprocessing spawn."""

    plan: Plan
    checks: list[RegionCheck]
    caches: CachesOff
    handles: list[Any]
    #: module -> the instance `forward` it had before the plan, or None (its class's)
    forwards: dict[nn.Module, Any]
    warned: bool = False
    #: the plan this one took over from between two training steps (the first-steps tuning's
    #: swap), while this one has not run: what `verify` reports until it has
    ran: Any = None
    #: the plan's offloading hooks (`remat.applying.offload.Offloader`), when it offloads
    offloader: Any = None


class _KeepPolicy:
    """A `context_fn` for checkpoint: fresh selective-checkpoint contexts per call whose policy
    keeps the ops whose stable key is in `check.expected`, counting occurrences separately in the
    forward and in the recomputation (they issue the same stream) and recording what the forward
    kept."""

    def __init__(self, check: RegionCheck, scope: list[str]):
        self.check = check
        self.scope = scope
        self.target_of: dict[Any, str] = {}
        #: the plan's offloading hooks: kept outputs made in an offloaded block go to host
        self.offloader: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "target_of": {}}  # a cache of op names; ops do not pickle

    def __call__(self) -> Any:
        counts: tuple[dict, dict] = ({}, {})
        keys, check, scope, target_of = self.check.expected, self.check, self.scope, self.target_of
        cache = OffloadingCache(self.offloader) if self.offloader is not None else None

        def policy(ctx, func, *args, **kwargs):
            target = target_of.get(func)
            if target is None:
                target = target_of[func] = key_target(str(func))
            at = (scope[-1], target)
            seen = counts[ctx.is_recompute]
            n = seen.get(at, 0)
            seen[at] = n + 1
            key = (*at, n)
            if key in keys:
                if not ctx.is_recompute:
                    check.running.add(key)
                    if cache is not None:  # a view's storage is another op's output
                        cache.next_to_host = not getattr(func, "is_view", False)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = create_selective_checkpoint_contexts(policy)
        if cache is not None:
            caching.storage = cached.storage = cache
        return caching, cached


class _EnterScope:
    """Forward pre-hook: `path` is now the innermost module running (as the tracer names ops'
    modules)."""

    def __init__(self, scope: list[str], path: str):
        self.scope, self.path = scope, path

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.scope.append(self.path)


class _LeaveScope:
    def __init__(self, scope: list[str]):
        self.scope = scope

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.scope.pop()


def scope_hooks(model: nn.Module, scope: list[str]) -> list[Any]:
    """Keep `scope[-1]` equal to the path of the innermost module running."""
    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(_EnterScope(scope, path)))
        handles.append(module.register_forward_hook(_LeaveScope(scope), always_call=True))
    return handles


def _batchnorms(modules: list[nn.Module]) -> list[nn.Module]:
    return [
        m
        for root in modules
        for m in root.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _restore_batchnorm_after_backward(
    norms: list[nn.Module], args: list, blocks: list[nn.Module]
) -> None:
    """Recomputation re-runs BatchNorm in training mode and updates its running statistics a
    second time. Snapshot them now, after the region's forward, and put them back once the
    region's backward (and so its recomputation) is done: when its input's gradient arrives, or,
    where no input needs one (a raw input, a frozen stem), when the gradient of one of its
    parameters does (a leaf's hook runs once all its uses are done, so after the recomputation;
    it comes off when it has run). Nothing here may run inside recomputation, whose op stream
    must match the forward's."""
    anchor = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
    if anchor is None:
        anchor = next((p for m in blocks for p in m.parameters() if p.requires_grad), None)
    if anchor is None:
        return
    snapshot = [[b.detach().clone() for b in m.buffers()] for m in norms]

    def restore(grad):
        with torch.no_grad():
            for m, buffers in zip(norms, snapshot, strict=True):
                for b, old in zip(m.buffers(), buffers, strict=True):
                    b.copy_(old)
        handle.remove()
        return grad

    handle = anchor.register_hook(restore)


class _RegionForward:
    """The `forward` of a region's first block: called as the model calls that block (positional,
    keyword or both), it runs the region's blocks under `torch.utils.checkpoint` (with the region's
    keep policy), each later one with the same arguments but `carry_argument`, which takes the
    previous block's output at `carry_output`, and returns the last block's output, whatever it is
    (a tensor, a tuple, a dict, a dataclass). Each block's path goes on the module stack: the
    recomputation calls `run` directly, outside `__call__` and so outside the blocks' own hooks.
    After each forward it counts the region and warns once per model when it kept fewer ops than
    planned."""

    def __init__(
        self,
        state: _Applied,
        check: RegionCheck,
        blocks: list[nn.Module],
        region: Region,
        scope: list[str],
    ):
        self.state, self.check = state, check
        self.blocks, self.paths, self.scope = blocks, list(region.modules), scope
        self.carry_output, self.carry_argument = region.carry_output, region.carry_argument
        self.context_fn = _KeepPolicy(check, scope) if check.expected else None
        self.preserve_rng_state = region.random
        #: the region's output, until the model has called its later blocks (`_PassThrough`)
        self.handed: Any = None

    @property
    def name(self) -> str:
        return self.paths[0] + (f" .. {self.paths[-1]}" if len(self.paths) > 1 else "")

    def run(self, *args: Any, **kwargs: Any) -> Any:
        out = None
        for k, (path, block) in enumerate(zip(self.paths, self.blocks, strict=True)):
            if k:
                try:
                    carried = pick(out, self.carry_output)
                except (KeyError, IndexError, AttributeError, TypeError):
                    raise RematError(
                        f"plan region {self.name}: {self.paths[k - 1]} returned no "
                        f"{self.carry_output!r} for {path} to take: the model runs differently "
                        "from the step the plan was made on; make the plan again (remat.auto)"
                    ) from None
                args, kwargs = with_argument(args, kwargs, self.carry_argument, carried)
            own = self.state.forwards[block]
            self.scope.append(path)
            try:
                out = (own or type(block).forward.__get__(block))(*args, **kwargs)
            finally:
                self.scope.pop()
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.blocks) > 1:
            self.require_carry_argument(args, kwargs, self.paths[0])
        if not torch.is_grad_enabled():
            out = self.run(*args, **kwargs)  # inference: nothing to save, no overhead
        else:
            kw = {"context_fn": self.context_fn} if self.context_fn is not None else {}
            out = checkpoint(
                self.run,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                **kw,
                **kwargs,
            )
            norms = _batchnorms(self.blocks)
            if norms:
                _restore_batchnorm_after_backward(
                    norms, pytree.tree_leaves((args, kwargs)), self.blocks
                )
            self.after_forward()
        if len(self.blocks) > 1:
            self.handed = out
        return out

    def require_carry_argument(self, args: tuple, kwargs: dict[str, Any], path: str) -> Any:
        try:
            return argument(args, kwargs, self.carry_argument)
        except KeyError:
            raise RematError(
                f"plan region {self.name}: {path} was called without argument "
                f"{self.carry_argument!r}, which carries each block's output to the next: the "
                "model calls it differently from the step the plan was made on; make the plan "
                "again (remat.auto)"
            ) from None

    def after_forward(self) -> None:
        check, state = self.check, self.state
        check.forwards += 1
        check.matched, check.running = frozenset(check.running), set()
        if check.missing and not state.warned:
            state.warned = True
            name, target, n = check.missing[0]
            warn(
                f"remat: the plan is not fully carried out in {', '.join(check.modules)}: "
                f"{len(check.matched)} of {len(check.expected)} kept ops matched (first missing: "
                f"occurrence {n} of {target} in {name or '<root>'}); memory and time differ from "
                "the plan. remat.verify(model) lists every region"
            )


def installed_plan(model: nn.Module) -> Plan | None:
    """The plan installed on `model` (by `remat.apply` or `remat.auto`), or None."""
    state = vars(model).get(_APPLIED)
    return None if state is None else state.plan


def installed_offloader(model: nn.Module) -> Any:
    """The offloading hooks of the plan installed on `model` (`remat.applying.offload.Offloader`:
    the bytes its latest forward copied, `enabled`), or None when it offloads nothing."""
    state = vars(model).get(_APPLIED)
    return None if state is None else state.offloader


def checkpointed_elsewhere(model: nn.Module) -> list[str]:
    """The paths of `model`'s modules that another tool already checkpoints: torch's
    `CheckpointWrapper` (accelerate's and Lightning's FSDP activation checkpointing,
    `apply_activation_checkpointing`), and Hugging Face layers with gradient checkpointing on
    (`gradient_checkpointing_enable()`, `TrainingArguments(gradient_checkpointing=True)`)."""
    found = []
    for path, module in model.named_modules():
        # fully_shard renames a module's class FSDP<name> (accelerate shards after wrapping)
        name = type(module).__name__.removeprefix("FSDP")
        wrapped = name in ("CheckpointWrapper", "OffloadWrapper")
        if wrapped or getattr(module, "gradient_checkpointing", False) is True:
            found.append(path or "<root>")
    return found


def refuse_double_checkpointing(model: nn.Module) -> None:
    found = checkpointed_elsewhere(model)
    if found:
        shown = ", ".join(repr(p) for p in found[:3]) + (
            f" and {len(found) - 3} more" if len(found) > 3 else ""
        )
        raise RematError(
            f"{len(found)} module(s) of the model are already checkpointed by another tool "
            f"({shown}): remat would checkpoint them twice. Turn that off and let remat plan the "
            "bare model: model.gradient_checkpointing_disable() (or TrainingArguments("
            "gradient_checkpointing=False)) for Hugging Face layers; no activation_checkpointing"
            " in accelerate's or Lightning's FSDP settings for CheckpointWrapper"
        )


def apply(model: nn.Module, plan: Plan, *, between_steps: bool = False) -> nn.Module:
    """Install `plan` on `model` in place (undo with `remove`): a plan made for, or read from JSON
    for, any model of the same architecture. The model then trains with caching off. Refused for
    a model another tool already checkpoints (`checkpointed_elsewhere`). `between_steps`: a swap
    between two training steps (`remat.applying.tune_steps`): until `plan` runs, `verify`
    reports the plan that ran the step before."""
    previous = vars(model).get(_APPLIED)
    ran = None
    if between_steps and previous is not None:
        ran = previous if any(c.forwards for c in previous.checks) else previous.ran
        previous.ran = None
    remove(model)
    refuse_double_checkpointing(model)
    named = dict(model.named_modules())
    for region in plan.regions:
        missing = [p for p in region.modules if p not in named]
        if missing:
            raise RematError(
                f"plan region {region.modules[0]!r}: the model has no submodule {missing[0]!r}; "
                "the plan was made for another architecture"
            )
    scope: list[str] = [""]
    selective = any(region.keep_keys for region in plan.regions)
    state = _Applied(
        plan=plan,
        checks=[],
        caches=CachesOff(model),
        handles=scope_hooks(model, scope) if selective else [],
        forwards={},
        ran=ran,
    )
    by_call: dict[nn.Module, dict[int, Any]] = {}  # repeated blocks: call number -> forward
    for region in plan.regions:
        check = RegionCheck(
            region.modules, frozenset((m, key_target(t), n) for m, t, n in region.keep_keys)
        )
        state.checks.append(check)
        blocks = [named[p] for p in region.modules]
        for block in blocks:
            state.forwards.setdefault(block, vars(block).get("forward"))
        first = _RegionForward(state, check, blocks, region, scope)
        for k, block in enumerate(blocks):
            forward = _PassThrough(first, k) if k else first
            if region.calls:
                by_call.setdefault(block, {})[region.calls[k]] = forward
            else:
                block.forward = forward
    if by_call:
        counted = [_ByCall(b, state.forwards[b], planned) for b, planned in by_call.items()]
        for c in counted:
            c.block.forward = c
        state.handles.append(model.register_forward_pre_hook(_NewForward(counted)))
    if plan.offload:  # the offloaded blocks' saves go to host memory (remat.applying.offload)
        state.offloader, handles = install_offload(
            model, plan.offload, plan.offload_min_bytes, plan.offload_saves
        )
        state.handles.extend(handles)
        for region in plan.regions:
            keep_policy = getattr(named[region.modules[0]].forward, "context_fn", None)
            if region.modules[0] in plan.offload and keep_policy is not None:
                keep_policy.offloader = state.offloader  # its kept outputs go to host too
    setattr(model, _APPLIED, state)
    return model


class _ByCall:
    """The `forward` of a block the model calls more than once (a block run in a loop) of which
    the plan checkpoints some calls (`Region.calls`): the forward's n-th call runs what the plan
    has for call n (a region's `_RegionForward`, or `_PassThrough` for a later block of one), any
    other call the block's own forward. A replay calls the blocks' own forwards: it counts none."""

    def __init__(self, block: nn.Module, own: Any, planned: dict[int, Any]):
        self.block, self.own, self.planned, self.count = block, own, planned, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.planned.get(self.count)
        self.count += 1
        if forward is None:
            forward = self.own or type(self.block).forward.__get__(self.block)
        return forward(*args, **kwargs)


class _NewForward:
    """The planned model's forward pre-hook: each forward numbers its blocks' calls from 0."""

    def __init__(self, counted: list[_ByCall]):
        self.counted = counted

    def __call__(self, module: nn.Module, args: Any) -> None:
        for c in self.counted:
            c.count = 0


class _PassThrough:
    """The `forward` of a later block of a region: the region's first block ran it already. The
    model calls it with what it took from the region's output, and gets that output back, so it
    takes the same from it again and ends with the last block's output. A call with anything else
    (the model runs differently from the traced step) is an error, not a skipped block."""

    def __init__(self, region: _RegionForward, index: int):
        self.region, self.index = region, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = self.region
        path = region.paths[self.index]
        given = region.require_carry_argument(args, kwargs, path)
        handed = region.handed
        try:
            taken = pick(handed, region.carry_output)
        except (KeyError, IndexError, AttributeError, TypeError):
            taken = None
        if handed is None or given is not taken:
            raise RematError(
                f"plan region {region.name}: {path} was called with an argument "
                f"{region.carry_argument!r} that is not what the region's blocks made (the "
                "region runs them all when its first block is called): the model runs "
                "differently from the step the plan was made on; make the plan again "
                "(remat.auto), or use a strategy whose regions hold one block (full, selective)"
            )
        if self.index == len(region.blocks) - 1:
            region.handed = None
        return handed


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: every module gets back exactly the `forward` it had, and hooks come off."""
    state = vars(model).get(_APPLIED)
    if state is None:
        return model
    for module, forward in state.forwards.items():
        if forward is None:
            del module.forward
        else:
            module.forward = forward
    for handle in state.handles:
        handle.remove()
    state.caches.remove()
    delattr(model, _APPLIED)
    return model


@dataclass(frozen=True)
class Verification:
    """How far the real run carried out a plan: per region, the kept ops its policy matched in
    the latest forward against the plan's; with example inputs, the bytes a measured step held
    for the backward at the end of its forward, and its peak, against the plan's predictions."""

    regions: tuple[RegionCheck, ...]
    kept_ops_expected: int
    kept_ops_matched: int
    held_bytes_predicted: int
    held_bytes_measured: int | None
    #: the plan's predicted peak without the optimizer it was planned with (`Plan.optimizer_bytes`):
    #: verify's measured step runs no optimizer (it would move the parameters)
    peak_bytes_predicted: int
    peak_bytes_measured: int | None
    #: modules another tool checkpoints around the plan (`checkpointed_elsewhere`), wrapped
    #: after it was installed: their own checkpointing overrides what the plan keeps
    checkpointed_elsewhere: tuple[str, ...] = ()
    #: measured steps, the least of whose bytes are compared, and why more than one
    #: (`late_freeing_backend`)
    steps_measured: int = 1
    why_steps: str = ""
    #: a plan that offloads: the drop of the peak its offload predicts, and the drop measured
    #: against the same step with the offloading hooks off (what Megatron reports by hand)
    offload_drop_predicted: int = 0
    offload_drop_measured: int | None = None
    #: the optimizer's part of the plan's peak, left out of `peak_bytes_predicted`
    optimizer_bytes: int = 0

    @property
    def offload_drop_ratio(self) -> float | None:
        """Measured drop / predicted drop of the peak from offload."""
        if self.offload_drop_measured is None or not self.offload_drop_predicted:
            return None
        return self.offload_drop_measured / self.offload_drop_predicted

    def __repr__(self) -> str:
        """The answer first: ok, then what it rests on (the per-region detail: `regions`)."""

        def versus(measured: int | None, predicted: int, ratio: float | None) -> str:
            if measured is None:
                return f"{format_bytes(predicted)} predicted (not measured: pass example inputs)"
            return f"{format_bytes(measured)} measured / {format_bytes(predicted)} ({ratio:.4f})"

        missing = [c for c in self.regions if c.missing]
        where = f", missing in {missing[0].modules[0]!r}" if missing else ""
        if self.checkpointed_elsewhere:
            where += f"; checkpointed elsewhere too: {', '.join(self.checkpointed_elsewhere)}"
        steps = f"; least of {self.steps_measured} steps: {self.why_steps}" * bool(self.why_steps)
        return (
            f"Verification(ok={self.ok}: kept ops {self.kept_ops_matched}/"
            f"{self.kept_ops_expected}{where}; held "
            f"{versus(self.held_bytes_measured, self.held_bytes_predicted, self.held_ratio)}; "
            f"peak {versus(self.peak_bytes_measured, self.peak_bytes_predicted, self.peak_ratio)}"
            + (
                f" (without the optimizer's {format_bytes(self.optimizer_bytes)})"
                if self.optimizer_bytes
                else ""
            )
            + (
                "; offload drops the peak by "
                + versus(
                    self.offload_drop_measured, self.offload_drop_predicted, self.offload_drop_ratio
                )
                if self.offload_drop_predicted
                else ""
            )
            + f"{steps})"
        )

    @property
    def held_ratio(self) -> float | None:
        if self.held_bytes_measured is None or not self.held_bytes_predicted:
            return None
        return self.held_bytes_measured / self.held_bytes_predicted

    @property
    def peak_ratio(self) -> float | None:
        if self.peak_bytes_measured is None or not self.peak_bytes_predicted:
            return None
        return self.peak_bytes_measured / self.peak_bytes_predicted

    @property
    def ok(self) -> bool:
        """Every kept op matched, nothing checkpointed around the plan by another tool; when
        measured, held bytes within 2% and the peak within 5%."""
        held, peak = self.held_ratio, self.peak_ratio
        return (
            self.kept_ops_matched == self.kept_ops_expected
            and not self.checkpointed_elsewhere
            and (held is None or abs(held - 1) <= 0.02)
            and (peak is None or abs(peak - 1) <= 0.05)
        )


def verify(model: nn.Module, *example_inputs: Any, **kwargs: Any) -> Verification:
    """Report what the plan installed on `model` did in its latest training forward. With example
    inputs (and the keyword arguments of the model's call, `loss_fn` included), first run one
    measured step (`remat.measure`) and compare the bytes it held with `plan.held_bytes` and its
    peak with the plan's (without the optimizer's part: the step runs none). The
    parameters' `.grad` are as the caller left them afterwards (the measured step's gradients
    are discarded), so verify may sit between `backward()` and `optimizer.step()`; the step does
    run the forward, so buffers a training forward updates (BatchNorm's statistics) move. A step
    whose ops depend on random draws (LayerDrop) is measured at both extremes of the draws and
    the longer compared, as it was planned (`remat.tracing.draws`). On a rank whose collectives'
    backend frees their outputs late (`late_freeing_backend`: gloo), the least of
    `LATE_FREE_STEPS` steps' bytes is compared, and the answer says so."""
    state = vars(model).get(_APPLIED)
    if state is None:
        raise RematError("verify: no plan is installed on this model; call remat.apply or auto")
    measured = without_offload = None
    why = late_freeing_backend(model)
    steps = LATE_FREE_STEPS if why else 1
    if example_inputs or kwargs:
        grads = [(p, p.grad) for p in model.parameters()]
        try:
            runs = [_measure_longest_draws(model, example_inputs, kwargs) for _ in range(steps)]
            measured = min(runs, key=lambda m: (m.peak_bytes, m.held_bytes))
            held = min(m.held_bytes for m in runs)
            if state.offloader is not None:
                state.offloader.enabled = False
                try:
                    without_offload = min(
                        (
                            _measure_longest_draws(model, example_inputs, kwargs)
                            for _ in range(steps)
                        ),
                        key=lambda m: m.peak_bytes,
                    )
                finally:
                    state.offloader.enabled = True
        finally:
            for p, grad in grads:
                p.grad = grad
    checks = [c for c in state.checks if c.expected]
    if measured is None and state.ran is not None and any(c.forwards == 0 for c in checks):
        state = state.ran  # swapped in between steps, not run yet: the plan that ran
        checks = [c for c in state.checks if c.expected]
    if any(c.forwards == 0 for c in checks):
        raise RematError(
            "verify: the model has not run a training forward since the plan was applied; run a "
            "step first, or pass example inputs to verify(model, *inputs)"
        )
    snapshot = tuple(RegionCheck(c.modules, c.expected, c.matched, c.forwards) for c in checks)
    return Verification(
        regions=snapshot,
        kept_ops_expected=sum(len(c.expected) for c in snapshot),
        kept_ops_matched=sum(len(c.matched) for c in snapshot),
        held_bytes_predicted=state.plan.held_bytes,
        held_bytes_measured=None if measured is None else held,
        peak_bytes_predicted=state.plan.predicted_peak_bytes - state.plan.optimizer_bytes,
        optimizer_bytes=state.plan.optimizer_bytes,
        peak_bytes_measured=None if measured is None else measured.peak_bytes,
        checkpointed_elsewhere=tuple(checkpointed_elsewhere(model)),
        offload_drop_predicted=state.plan.offload_drop_bytes,
        offload_drop_measured=None
        if without_offload is None
        else without_offload.peak_bytes - measured.peak_bytes,
        steps_measured=steps if measured is not None else 0,
        why_steps=why if measured is not None else "",
    )


#: Steps `verify` measures on a rank whose backend frees collective outputs late.
LATE_FREE_STEPS = 3


def late_freeing_backend(model: nn.Module) -> str:
    """Why one measured step of `model` may overcount, or "": its parameters are DTensors
    (tensor parallelism, FSDP2) on a live gloo process group, whose worker thread sometimes
    drops the last reference to a collective's output, a free the profiler does not record, so
    that step's peak counts the tensor live to its end (up to +4.4% on a tiny Llama's TP step,
    docs/parallelism.md). Late frees only add bytes: the least of a few steps is the step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return ""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return ""
    return "gloo frees collective outputs late, on its worker thread"


def _measure_longest_draws(model: nn.Module, inputs: tuple, kwargs: dict[str, Any]) -> Any:
    """One measured step with random draws at their low extreme (`remat.tracing.draws`); where a draw
    decided something (LayerDrop), at the high one too: the longer step, which the plan was made
    for. At one extreme the step may not train at all (every layer skipped)."""
    try:
        low = measure(model, *inputs, draws="low", **kwargs)
    except RematError as err:
        low, failure = None, err
    if low is not None and not low.random_reads:
        return low
    try:
        high = measure(model, *inputs, draws="high", **kwargs)
    except RematError:
        if low is None:
            raise failure from None
        return low
    if low is None:
        return high
    return max(low, high, key=lambda m: (m.held_bytes, m.peak_bytes))
