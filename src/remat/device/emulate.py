"""Trace a step as its target device runs it: the rules of `remat.device.targets`, installed on fake CPU
tensors for the time of one trace.

Three mechanisms, one per level of PyTorch's dispatch at which the devices part ways:
- autocast (above autograd): the CPU autocast key's kernels are replaced, for the trace, by the
  CUDA cast policies of `targets.CUDA_AUTOCAST` (ops CPU autocast lists and CUDA's does not fall
  through), with autocast's cache of low-precision weight copies;
- composite ops that pick another kernel on CUDA (`targets.CUDA_REROUTES`, at the autograd key):
  dropout runs `native_dropout`, rms_norm `_fused_rms_norm`, SDPA the backend
  `targets.select_attention` picks, so autograd saves what the CUDA kernels save;
- kernel outputs (below autograd, in the tracer's dispatch mode): `fake_kernel(target, op)`
  gives a CUDA-only kernel its outputs on fake tensors, and normalisation statistics their fp32.

Everything registered is removed when the trace ends (`torch.library.Library._destroy`). The CPU
target installs nothing: a CPU trace is the CPU's own dispatch, exact to the byte on this machine.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from remat.device import targets
from remat.device.targets import AttentionCall, Target
from remat.errors import TraceError

_AUTOCAST_KEY = torch._C.DispatchKey.AutocastCPU
_NO_AUTOCAST = torch._C.DispatchKeySet(_AUTOCAST_KEY)


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


# -- autocast ------------------------------------------------------------------------------------
class _Autocast:
    """CUDA autocast's policies on CPU tensors: the CPU tensors of a CUDA-target trace stand for
    CUDA tensors, so "eligible" (autocast_mode.h `is_eligible`) is: floating, not fp64."""

    def __init__(self, lower: torch.dtype):
        self.lower = lower
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def eligible(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def cast(self, to: torch.dtype, t: Any) -> Any:
        """autocast_mode.cpp `cached_cast`: low-precision copies of fp32 leaves that require grad
        (the weights) are made once per autocast region."""
        if not self.eligible(t) or t.dtype == to:
            return t
        cacheable = (
            to == self.lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
        )
        if not cacheable:
            return t.to(to)
        hit = self.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cache[id(t)] = (t, t.to(to))
        return hit[1]

    def cast_all(self, to: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Each argument cast, the last first: the C++ wrapper (autocast_mode.h
        `WrapFunction_`) casts them in one call's argument list, which GCC evaluates right to
        left (a linear's bias, then weight, then input: on an H100 and on the CPU alike); a
        list's items left to right."""
        values = [*args, *kwargs.values()]
        cast = [None] * len(values)
        for i in reversed(range(len(values))):
            cast[i] = pytree.tree_map_only(torch.Tensor, lambda t: self.cast(to, t), values[i])
        return tuple(cast[: len(args)]), dict(zip(kwargs, cast[len(args) :], strict=True))

    def widest(self, args: tuple, kwargs: dict) -> torch.dtype:
        """autocast_mode.h `promote_type`: fp32 if any eligible input is fp32, else the low one."""
        leaves = pytree.tree_leaves((args, kwargs))
        return (
            torch.float32
            if any(self.eligible(t) and t.dtype == torch.float32 for t in leaves)
            else self.lower
        )

    def kernel(self, op: torch._ops.OpOverload, policy: str) -> Callable[..., Any]:
        dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
                if policy == "lower_precision_fp":
                    args, kwargs = self.cast_all(self.lower, args, kwargs)
                elif policy == "fp32":
                    args, kwargs = self.cast_all(torch.float32, args, kwargs)
                elif policy == "promote":
                    args, kwargs = self.cast_all(self.widest(args, kwargs), args, kwargs)
                elif policy == "fp32_set_opt_dtype" and self.eligible(args[0]):
                    if dtype_at is not None and dtype_at < len(args):
                        if args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                elif policy == "fp32_append_dtype":
                    dtype = torch.float32 if self.eligible(args[0]) else args[0].dtype
                    with_dtype = {
                        "Scalar": torch.ops.aten.norm.ScalarOpt_dtype,
                        "ScalarOpt_dim": torch.ops.aten.norm.ScalarOpt_dim_dtype,
                    }[op._overloadname]
                    return with_dtype(*args, **kwargs, dtype=dtype)
                return op(*args, **kwargs)

        return run


def _banned(*args: Any, **kwargs: Any) -> Any:
    raise TraceError(
        "torch.nn.functional.binary_cross_entropy (nn.BCELoss) is refused by CUDA autocast as "
        "unsafe: use binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss) on the logits"
    )


def _cpu_autocast_ops() -> list[str]:
    """The ops CPU autocast registers a kernel for (the rest fall through)."""
    return [
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")
    ]


# -- reroutes: the CUDA path of composite ops --------------------------------------------------------
def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """Dropout.cpp `dropout`: the fused kernel when it is acceptable on CUDA; at p = 0, in
    evaluation or on an empty tensor the input itself (`_dropout_impl`), where the Python
    decomposition clones it."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p < 1:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    return torch.ops.aten.dropout.default.decompose(input, p, train)


def _rms_norm(
    input: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """layer_norm.cpp `rms_norm_symint`: the fused kernel unless the input is channels-last or
    complex, or the weight's dtype differs from the input's."""
    channels_last = (
        input.dim() == 4
        and not input.is_contiguous()
        and input.is_contiguous(memory_format=torch.channels_last)
    )
    composite = (
        input.is_complex() or channels_last or (weight is not None and weight.dtype != input.dtype)
    )
    if composite:
        return torch.ops.aten.rms_norm.default.decompose(input, normalized_shape, weight, eps)
    return torch.ops.aten._fused_rms_norm.default(input, list(normalized_shape), weight, eps)[0]


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    """attention.cpp `pad_last_dim<8>`: the flash kernel takes head dims in multiples of 8."""
    pad = -t.shape[-1] % 8
    return F.pad(t, (0, pad)) if pad else t


def _sdpa(target: Target) -> Callable[..., torch.Tensor]:
    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """attention.cpp `scaled_dot_product_attention` on CUDA: select the backend, then call
        its op as torch does."""
        qkv = (query, key, value)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in qkv)
        call = AttentionCall(
            dtype=str(query.dtype).removeprefix("torch."),
            head_dim_qk=query.shape[-1],
            head_dim_v=value.shape[-1],
            seq_q=query.shape[-2],
            seq_k=key.shape[-2],
            heads_q=query.shape[-3] if query.dim() > 2 else 1,
            heads_kv=key.shape[-3] if key.dim() > 2 else 1,
            has_mask=attn_mask is not None,
            dropout=dropout_p,
            is_causal=is_causal,
            requires_grad=needs_grad,
            last_dim_contiguous=all(t.stride(-1) == 1 for t in qkv),
        )
        backend = targets.select_attention(target, call)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # attention.cpp `convert_boolean_attn_mask`: an additive mask of the query's dtype
            attn_mask = torch.where(
                attn_mask,
                torch.zeros((), dtype=query.dtype),
                torch.full((), float("-inf"), dtype=query.dtype),
            )
        if backend == "flash":
            if scale is None:
                scale = query.shape[-1] ** -0.5
            out = torch.ops.aten._scaled_dot_product_flash_attention.default(
                *(_pad_head_dim(t) for t in qkv), dropout_p, is_causal, False, scale=scale
            )[0]
            return out[..., : value.shape[-1]]
        if backend == "efficient":
            return torch.ops.aten._scaled_dot_product_efficient_attention.default(
                *qkv, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        if backend == "cudnn":
            return torch.ops.aten._scaled_dot_product_cudnn_attention.default(
                *qkv, attn_mask, needs_grad, dropout_p, is_causal, False, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            *qkv, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]

    return sdpa


class _SoftmaxKeepingInput(torch.autograd.Function):
    """softmax / log_softmax as torch < 1.11's autograd ran them: the input kept for backward
    beside the output (derivatives.yaml passed `self` to `_softmax_backward_data`)."""

    @staticmethod
    def forward(ctx: Any, op: Any, backward: Any, input: torch.Tensor, dim: int, half: bool) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            output = op(input, dim, half)
        ctx.save_for_backward(input, output)
        ctx.backward_op, ctx.dim = backward, dim
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        input, output = ctx.saved_tensors
        return None, None, ctx.backward_op(grad, output, ctx.dim, input.dtype), None, None


def _softmax_keeping_input(forward: Any, backward: Any) -> Callable[..., torch.Tensor]:
    def run(input: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        return _SoftmaxKeepingInput.apply(forward, backward, input, dim, half_to_float)

    return run


def _reroutes(target: Target) -> dict[str, Callable[..., Any]]:
    reroutes: dict[str, Callable[..., Any]] = {
        "dropout": _dropout,
        "rms_norm": _rms_norm,
        "scaled_dot_product_attention": _sdpa(target),
    }
    if target.softmax_keeps_input:
        aten = torch.ops.aten
        reroutes["_softmax"] = _softmax_keeping_input(
            aten._softmax.default, aten._softmax_backward_data.default
        )
        reroutes["_log_softmax"] = _softmax_keeping_input(
            aten._log_softmax.default, aten._log_softmax_backward_data.default
        )
    return reroutes


def _unreachable_cpu_kernel(*args: Any, **kwargs: Any) -> Any:
    raise TraceError(
        "a CUDA-target trace ran a CUDA-only kernel on real CPU tensors: trace a CUDA target on "
        "fake tensors (device='meta')"
    )


# -- kernel outputs below autograd --------------------------------------------------------------------
def _fused_rms_norm(
    input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's outputs (layer_norm_kernel.cu): y like the input, rstd fp32 with the
    normalised dimensions kept as 1."""
    stats = (*input.shape[: input.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
    return torch.empty_like(input), input.new_empty(stats, dtype=torch.float32)


def _fused_rms_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    normalized_shape: list[int],
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (
        torch.empty_like(input) if output_mask[0] else None,
        torch.empty_like(weight) if output_mask[1] and weight is not None else None,
    )


_CUDA_ONLY_KERNELS: dict[str, Callable[..., Any]] = {
    "_fused_rms_norm": _fused_rms_norm,
    "_fused_rms_norm_backward": _fused_rms_norm_backward,
}


def fake_kernel(target: Target, packet: str) -> Callable[..., Any] | None:
    """The target's own fake kernel for op `packet`, to run instead of torch's on fake CPU tensors
    (called as `kernel(func, args, kwargs)`), or None."""
    if not target.is_cuda:
        return None
    own = _CUDA_ONLY_KERNELS.get(packet)
    fp32_outputs = targets.CUDA_FP32_STATISTICS.get(packet)
    if own is None and fp32_outputs is None:
        return None

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = own(*args, **kwargs) if own is not None else func(*args, **kwargs)
        if fp32_outputs is None:
            return out
        return tuple(
            t.to(torch.float32)
            if i in fp32_outputs and isinstance(t, torch.Tensor) and t.dtype in _HALF
            else t
            for i, t in enumerate(out)
        )

    return run


_HALF = (torch.float16, torch.bfloat16)


# -- installing a target for one trace ----------------------------------------------------------------
class Installed:
    """A target installed for one trace: `autocast()` is the forward's mixed-precision region."""

    def __init__(self, dtype: torch.dtype | None, device_type: str, policy: _Autocast | None):
        self.dtype, self.device_type, self.policy = dtype, device_type, policy

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """`torch.autocast` over the forward and the loss (nothing without a dtype); its cache of
        weight copies dies when the region ends, as autocast's does."""
        if self.dtype is None:
            yield
            return
        try:
            with torch.autocast(self.device_type, dtype=self.dtype):
                yield
        finally:
            if self.policy is not None:
                self.policy.cache.clear()


@contextlib.contextmanager
def installed(
    target: Target, autocast: torch.dtype | None = None, device_type: str = "cpu"
) -> Iterator[Installed]:
    """The target's dispatch for the duration of a trace on fake CPU tensors, with `autocast`
    (bf16 or fp16, or None) the dtype of its mixed-precision region. The CPU target installs
    nothing: its autocast is that of the traced tensors' device (`device_type`)."""
    if not target.is_cuda:
        yield Installed(autocast, device_type, None)
        return
    library = torch.library.Library("aten", "IMPL")
    policy = _Autocast(autocast) if autocast is not None else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name, kernel in _reroutes(target).items():
                library.impl(name, kernel, "AutogradCPU")
            # A CPU kernel makes the dispatcher run `_fused_rms_norm`'s autograd formula on CPU
            # tensors instead of its composite; the tracer's fake kernel answers for it.
            library.impl("_fused_rms_norm", _unreachable_cpu_kernel, "CPU")
            if policy is not None:
                _install_cuda_autocast(library, policy)
        yield Installed(autocast, "cpu", policy)
    finally:
        if policy is not None:
            policy.cache.clear()
        library._destroy()


def _install_cuda_autocast(library: torch.library.Library, policy: _Autocast) -> None:
    """CUDA's cast policy on every op of `targets.CUDA_AUTOCAST`, at the CPU autocast key; the
    ops only CPU autocast lists fall through."""
    cuda_ops = {
        name: policy_name for policy_name, names in targets.CUDA_AUTOCAST.items() for name in names
    }
    for name in _cpu_autocast_ops():
        if name not in cuda_ops and name not in targets.CUDA_AUTOCAST_BANNED:
            library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    for name, policy_name in cuda_ops.items():
        library.impl(name, policy.kernel(_overload(name), policy_name), "AutocastCPU")
    for name in targets.CUDA_AUTOCAST_BANNED:
        library.impl(name, _banned, "AutocastCPU")
