"""remat in torchtitan: an activation-checkpointing policy, `RematAC`, that plans which
activations the transformer blocks keep and which they recompute under a byte budget.

    from remat.integrations.torchtitan import trainer_config

    def llama3_8b_remat() -> Trainer.Config:          # a config function, as torchtitan's
        return trainer_config(llama3_8b(), budget="70%")

`trainer_config` sets `activation_checkpoint=RematAC.Config(budget=...)` on a Trainer.Config
whose field also admits it (torchtitan's tyro union lists only its own three policies), and which
fills the step's shape in from `training` after the command line is parsed:
`--module my_configs --config llama3_8b_remat activation-checkpoint:remat
--activation-checkpoint.budget 60%`. A Trainer.Config may also carry `RematAC.Config(budget=...,
local_batch_size=..., seq_len=...)` directly (tyro then warns that it is not in the union and
cannot change its fields from the command line).

torchtitan calls `ac_config.build(dump_folder=...).apply(model)` in its parallelize function,
on the meta model after tensor parallelism and before compile and FSDP. `apply` traces one
training step of that model (meta weights; DTensors after TP: the rank's local ops) on fake
tensors: `local_batch_size` x `seq_len` tokens and their positions, the parameters in FSDP's
compute dtype (`mixed_precision_param`), the trainer's loss (`cross_entropy_loss` over the
logits, divided by the tokens), on this process's device (`target`). It plans under `budget`
and installs the plan on the model's blocks (`remat.apply`: checkpoint regions with selective
policies on the blocks' `forward`), which the trainer's `to_empty`, `init_weights` and
`fully_shard` leave in place. `RematAC.plan_of(model)` is the plan; `remat.verify(model)` checks
that a step carried it out.

Refused: a model whose layers something already checkpoints (`CheckpointWrapper`: FullAC or
SelectiveAC applied too, or `checkpoint_wrapper` by hand); a pipeline stage without the token
embedding. Not planned for: torch.compile of the blocks (`compile.enable` with "model": the
compiler partitions the block itself; `remat.compile` plans compiled steps), FlexAttention and
varlen attention (compiled / CUDA kernels the fake trace cannot run; select
`ScaledDotProductAttention`), and `ChunkedLossWrapper` (the plan is made for the full logits, so
its predicted peak is high by the logits it never holds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, make_dataclass
from functools import cache
from typing import Annotated, Any, Literal

import torch
import tyro
from torch import nn

from remat.applying import first_step
from remat.applying.eager import apply as install
from remat.applying.eager import checkpointed_elsewhere, installed_plan
from remat.errors import RematError, log, warn
from remat.planning.plans import DEFAULT_BUDGET, Plan
from remat.units import format_bytes

try:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointing,
        ActivationCheckpointingConfig,
    )
except ImportError as err:  # pragma: no cover - torchtitan is missing
    raise ImportError(
        "remat.integrations.torchtitan needs torchtitan >= 0.3: pip install torchtitan"
    ) from err

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class RematAC(ActivationCheckpointing):
    """Activation checkpointing planned by remat under a byte budget (see the module docstring).
    `plan` is the installed `Plan` once `apply` ran."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        budget: int | str = DEFAULT_BUDGET
        """Peak bytes of one rank's step: an int, "40GiB", "70%" (the fixed memory plus that
        share of the rest of store-all's peak) or "+10%" (the lowest peak within 10% more
        predicted step time). Judged on the traced step, whose parameters and gradients are
        whole: under FSDP prefer a share."""

        local_batch_size: int = 0
        """Sequences per step on one rank; 0: training.local_batch_size (`trainer_config`)."""

        seq_len: int = 0
        """Tokens per sequence; 0: training.seq_len (`trainer_config`)."""

        mixed_precision_param: Literal["bfloat16", "float32", ""] = ""
        """The dtype the blocks compute in, which torchtitan's fully_shard casts the parameters
        to; "": training.mixed_precision_param (`trainer_config`), else bfloat16, its default."""

        positions: bool = True
        """Pass per-token positions to the model, as torchtitan's dataloaders do (RoPE then
        gathers its table by position)."""

        strategy: str = "auto"
        """A remat strategy (`remat.planning.strategies`): auto, full, first_k, selective:..."""

        target: str = ""
        """The device the step is planned for: "cpu", "cuda", "cuda:sm80"; "" for this
        process's (the current CUDA device when there is one)."""

        profile: str = ""
        """remat's cost profile for recompute time (cpu, a100, h100, ...); "" for the target's."""

        check: bool = True
        """Check the first training step against the plan, once, warning where the bytes it
        holds or (CUDA) its peak differ (`remat.applying.first_step`; skipped where the
        parameters are DTensors, as under FSDP and tensor parallelism)."""

        _training: Annotated[tuple[int, int, str] | None, tyro.conf.Suppress] = None
        """training's (local_batch_size, seq_len, mixed_precision_param), set by the
        Trainer.Config of `trainer_config` each time it is made (after the command line)."""

        def step_shape(self) -> tuple[int, int, torch.dtype]:
            """(batch, seq, compute dtype) of the step to plan: the fields, else training's."""
            batch, seq, dtype = self._training or (0, 0, "")
            batch, seq = self.local_batch_size or batch, self.seq_len or seq
            if batch < 1 or seq < 1:
                raise RematError(
                    "RematAC.Config needs the step's shape: set local_batch_size and seq_len "
                    "(training's), or make the Trainer.Config with remat.integrations.torchtitan."
                    "trainer_config, which takes them from config.training"
                )
            return batch, seq, _DTYPES[self.mixed_precision_param or dtype or "bfloat16"]

    def __init__(self, config: RematAC.Config, dump_folder: str = ""):
        super().__init__(config, dump_folder)
        self.plan: Plan | None = None

    @staticmethod
    def plan_of(model: nn.Module) -> Plan | None:
        """The plan installed on `model` (torchtitan's parallelize function builds the policy
        and drops it; the plan stays with the model)."""
        return installed_plan(model)

    def apply(self, model: nn.Module) -> None:
        config: RematAC.Config = self.config  # type: ignore[assignment]
        _refuse(model)
        batch, seq, dtype = config.step_shape()
        target, profile = _target_and_profile(config.target, config.profile)
        tokens = torch.empty((batch, seq), dtype=torch.long, device="meta")
        kwargs = {}
        if config.positions:
            kwargs["positions"] = torch.empty((batch, seq), dtype=torch.long, device="meta")
        from remat.planning.planner import plan
        from remat.tracing.trace import trace

        with _parameters_in(model, dtype):
            graph = trace(
                model, tokens, loss_fn=_token_loss, target=target, device="meta", **kwargs
            )
        self.plan = plan(graph, budget=config.budget, strategy=config.strategy, profile=profile)
        install(model, self.plan)
        if config.check:
            first_step.install(model, self.plan)
        model.register_forward_pre_hook(_ShapeCheck(batch, seq), with_kwargs=True)
        regions = len(self.plan.regions)
        log.info(
            "remat: RematAC installed %s on %s (%d region%s): predicted peak %s for %d x %d "
            "tokens on %s",
            self.plan.strategy,
            type(model).__name__,
            regions,
            "" if regions == 1 else "s",
            format_bytes(self.plan.predicted_peak_bytes),
            batch,
            seq,
            target,
        )


def _token_loss(pred: torch.Tensor) -> torch.Tensor:
    """torchtitan's `CrossEntropyLoss` as the trainer calls it on one rank without gradient
    accumulation: the summed cross-entropy over the fp32 logits, divided by the tokens (the
    labels' values do not matter to a fake trace)."""
    labels = torch.zeros(pred.shape[:2], dtype=torch.long, device=pred.device)
    return cross_entropy_loss(pred, labels) / labels.numel()


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _refuse(model: nn.Module) -> None:
    wrapped = checkpointed_elsewhere(model)
    if wrapped:
        shown = ", ".join(repr(p) for p in wrapped[:3]) + (
            f" and {len(wrapped) - 3} more" if len(wrapped) > 3 else ""
        )
        raise RematError(
            f"RematAC: {shown} already checkpointed (CheckpointWrapper, as torchtitan's FullAC "
            "and SelectiveAC wrap layers): remat would checkpoint them twice. Select RematAC "
            "alone in activation_checkpoint, and leave the layers unwrapped in your parallelize "
            "function"
        )
    if getattr(model, "tok_embeddings", None) is None or not hasattr(model, "layers"):
        raise RematError(
            f"RematAC plans a whole decoder (tokens in, tok_embeddings, layers): "
            f"{type(model).__name__} has no tok_embeddings, as a later pipeline stage has not. "
            "Pipeline parallelism: remat.layouts.pipeline plans per stage"
        )


def _target_and_profile(target: str, profile: str) -> tuple[str, str]:
    if not target:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            target = f"cuda:sm{major}{minor}"
        else:
            target = "cpu"
    if not profile:
        profile = "cpu"
        if target.startswith("cuda"):
            from remat.device.gpus import get_gpu

            profile = "h100"
            if torch.cuda.is_available():
                with contextlib.suppress(RematError):
                    profile = get_gpu(torch.cuda.get_device_name()).profile
    return target, profile


def _stand_in(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of `p`'s layout in `dtype` (a DTensor stays one, over a meta shard)."""
    if _is_dtensor(p):
        from torch.distributed.tensor import DTensor

        local = _stand_in(p.to_local(), dtype)
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=dtype, device="meta")


@contextlib.contextmanager
def _parameters_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The floating parameters as `dtype` stand-ins for the trace, as FSDP2's
    `MixedPrecisionPolicy(param_dtype=...)` casts them for compute (buffers stay as they are);
    tied parameters stay tied. The model's own parameters are back afterwards."""
    swapped: dict[int, nn.Parameter] = {}
    originals = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in swapped:
                stand_in = nn.Parameter(_stand_in(p, dtype), requires_grad=p.requires_grad)
                swapped[id(p)] = stand_in
            originals.append((module, name, p))
            module._parameters[name] = swapped[id(p)]
    try:
        yield
    finally:
        for module, name, p in originals:
            module._parameters[name] = p


class _ShapeCheck:
    """Forward pre-hook: warns once when a training step's tokens are not the planned shape (the
    plan still runs, but its memory is another step's)."""

    def __init__(self, batch: int, seq: int):
        self.planned = (batch, seq)
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("tokens")
        if self.warned or not torch.is_grad_enabled() or not isinstance(tokens, torch.Tensor):
            return
        shape = tuple(tokens.shape)
        if _is_dtensor(tokens):
            shape = tuple(tokens.to_local().shape)
        if shape != self.planned:
            self.warned = True
            warn(
                f"remat: RematAC planned {self.planned[0]} x {self.planned[1]} tokens a step, the "
                f"model got {shape[0]} x {shape[-1]}: the plan runs, but its memory is not the "
                "one planned. Give RematAC.Config training's local_batch_size and seq_len, or "
                "make the Trainer.Config with remat.integrations.torchtitan.trainer_config"
            )


def trainer_config(config: Any, **fields_of_remat_ac: Any) -> Any:
    """`config` (a torchtitan `Trainer.Config`, or a subclass) with `activation_checkpoint =
    RematAC.Config(**fields_of_remat_ac)`, as an instance of a subclass of its class whose
    `activation_checkpoint` union also names `RematAC.Config` (tyro subcommand "remat"), and
    which gives the policy training's batch, sequence length and compute dtype each time it is
    made: after torchtitan's command line (`--training.seq_len 4096` included) too."""
    cls = _with_remat_ac(type(config))
    made = cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})
    made.activation_checkpoint = RematAC.Config(**fields_of_remat_ac)
    made.__post_init__()
    return made


@cache
def _with_remat_ac(base: type) -> type:
    """A subclass of the Trainer.Config class `base` whose `activation_checkpoint` also admits
    RematAC.Config, and whose `__post_init__` hands it training's step shape."""
    if getattr(base, "_admits_remat_ac", False):
        return base

    def __post_init__(self: Any) -> None:
        base.__post_init__(self)
        ac = self.activation_checkpoint
        if isinstance(ac, RematAC.Config):
            t = self.training
            ac._training = (t.local_batch_size, t.seq_len, t.mixed_precision_param)

    default = next(f for f in fields(base) if f.name == "activation_checkpoint")
    union = ActivationCheckpointingConfig | Annotated[RematAC.Config, tyro.conf.subcommand("remat")]
    cls = make_dataclass(
        base.__name__,
        [("activation_checkpoint", union, field(default_factory=default.default_factory))],
        bases=(base,),
        namespace={
            "__post_init__": __post_init__,
            "__module__": base.__module__,
            "_admits_remat_ac": True,
        },
        kw_only=True,
        slots=True,
    )
    cls.__qualname__ = base.__qualname__
    return cls
