"""float8 training as torchao's `Float8Linear` runs it (torchtitan's `--model.converters float8`):
each `nn.Linear` whose dimensions are multiples of 16 (torchtitan's `module_filter_fn`), but the
output head (its train configs' `filter_fqns = ["output"]`), swapped for a linear whose matmuls
run in float8 (`convert_to_float8`).

Where torchao imports, the swap is torchao's own `convert_to_float8_training`. Where it does not,
a stand-in (`Float8Linear` here) runs torchao's rules, read from pytorch/ao at commit 36027d82
(torchao/float8/float8_linear.py `matmul_with_hp_or_float8_args`, float8_scaling_utils.py,
float8_utils.py `tensor_to_amax` / `amax_to_scale` / `to_fp8_saturated`,
float8_training_tensor.py `_ToFloat8ConstrFunc`, float8_ops.py `preprocess_addmm` /
`addmm_float8_unwrapped`, fsdp_utils.py `WeightWithDynamicFloat8CastTensor`), as the same aten
ops in eager mode:

- autograd saves the high-precision input and the high-precision weight, nothing in float8
  (`ctx.save_for_backward(input_hp, weight_hp_t)`): memory-neutral against `nn.Linear`, which
  saves the same two (torchao 0.10's tensorwise linears, traced where it imports, cast the
  weight before that Function and so save it in float8, with its scale: one byte an element
  more per linear);
- each operand is cast on the way in, forward and backward: amax (`abs` then `max`, per tensor or
  per row), the scale (`finfo.max / clamp(amax, 1e-12)` in fp64, then fp32, rounded down to a
  power of 2 for rowwise), then `(x.float() * scale).clamp(-max, max).to(float8)`: temporaries of
  fp32 and float8 bytes that die with the matmul;
- `torch._scaled_mm` takes its first operand row-major and its second column-major: a float8
  operand in the other layout is copied (`contiguous()`), as torchao does;
- under FSDP's float8 all-gather (`enable_fsdp_float8_all_gather`, tensorwise only), the weight
  arrives in float8: the gathered weight is one byte an element, and it is not cast again. The
  stand-in reads it as a float8 view of the traced weight (no allocation: the gathered buffer is
  FSDP's, which `remat.prediction.estimate.param_gather_bytes` prices at one byte an element).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: torchao's `EPS` (float8_utils.py): the least amax a scale is computed from.
EPS = 1e-12


@dataclass(frozen=True)
class Float8Recipe:
    """One of torchao's `Float8LinearRecipeName`s, as its `Float8LinearConfig` sets the casts."""

    name: str  # torchao's recipe name
    rowwise: bool  # one scale per row (AXISWISE) instead of one per tensor
    grad_dtype: torch.dtype  # grad_output's float8 dtype
    power_of_2: bool  # scales rounded down to a power of 2 (round_scales_to_power_of_2)
    all_gather: bool = False  # FSDP all-gathers the weights in float8


RECIPES: dict[str, Float8Recipe] = {
    # Float8LinearConfig(): e4m3 input and weight, e5m2 grad_output, one scale per tensor
    "tensorwise": Float8Recipe("tensorwise", False, torch.float8_e5m2, False),
    # + enable_fsdp_float8_all_gather=True: torchao's "best settings" for tensorwise
    "tensorwise-all-gather": Float8Recipe("tensorwise", False, torch.float8_e5m2, False, True),
    # from_recipe_name("rowwise"): every cast e4m3 and axiswise, scales rounded to powers of 2
    "rowwise": Float8Recipe("rowwise", True, torch.float8_e4m3fn, True),
}


def _is_row_major(t: torch.Tensor) -> bool:
    """torchao's `is_row_major` (float8_utils.py) on a 2-D tensor's strides."""
    return t.stride()[0] > t.stride()[1] and t.stride()[1] == 1


def _cast(
    hp: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's `hp_tensor_to_float8_dynamic`: the float8 data and its fp32 scale (`dim`: the
    axis one scale spans, rowwise; None: one scale for the tensor)."""
    amax = torch.abs(hp).max() if dim is None else torch.amax(torch.abs(hp), dim=dim, keepdim=True)
    amax = amax.to(torch.float64)
    scale = (torch.finfo(dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    top = torch.finfo(dtype).max
    scaled = hp.to(torch.float32) * scale
    return scaled.clamp(min=-top, max=top).to(dtype), scale


def _scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: Any
) -> torch.Tensor:
    """torchao's `preprocess_addmm` and `addmm_float8_unwrapped`: `a` row-major and `b`
    column-major (copied where not), the inverse scales, `torch._scaled_mm`."""
    if not _is_row_major(a):
        a = a.contiguous()
    if _is_row_major(b):
        b = b.t().contiguous().t()
    return torch._scaled_mm(
        a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out
    )


def _as_float8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as FSDP's float8 all-gather hands it over: float8 bytes of the traced weight,
    a view (the gathered buffer is FSDP's), with its scale (precomputed once per step)."""
    w = weight_t.t()  # (out, in), contiguous as the parameter is
    data = w.view(torch.float8_e4m3fn)[:, : w.shape[1]] if w.element_size() > 1 else w
    return data.t(), torch.ones((), dtype=torch.float32, device=w.device)


class _Float8Matmul(torch.autograd.Function):
    """torchao's `matmul_with_hp_or_float8_args` (see the module)."""

    @staticmethod
    def forward(ctx: Any, input_hp: torch.Tensor, weight_hp_t: torch.Tensor, recipe: Any) -> Any:
        ctx.save_for_backward(input_hp, weight_hp_t)
        ctx.recipe = recipe
        r = recipe
        x8, x_scale = _cast(input_hp, torch.float8_e4m3fn, -1 if r.rowwise else None, r.power_of_2)
        if r.all_gather:
            w8, w_scale = _as_float8(weight_hp_t)
        else:
            w8, w_scale = _cast(
                weight_hp_t, torch.float8_e4m3fn, 0 if r.rowwise else None, r.power_of_2
            )
        shape = x8.shape
        x_scale = x_scale.reshape(-1, 1) if r.rowwise else x_scale
        out = _scaled_mm(x8.reshape(-1, shape[-1]), x_scale, w8, w_scale, input_hp.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        input_hp, weight_hp_t = ctx.saved_tensors
        r = ctx.recipe
        shape = grad_output.shape
        go = grad_output.reshape(-1, shape[-1])
        go8, go_scale = _cast(go, r.grad_dtype, -1 if r.rowwise else None, r.power_of_2)
        if r.all_gather:
            w8, w_scale = _as_float8(weight_hp_t)
        else:
            w8, w_scale = _cast(
                weight_hp_t, torch.float8_e4m3fn, -1 if r.rowwise else None, r.power_of_2
            )
        grad_input = _scaled_mm(go8, go_scale, w8.t(), w_scale.t(), grad_output.dtype)
        grad_input = grad_input.reshape(*shape[:-1], grad_input.shape[-1])
        x = input_hp.reshape(-1, input_hp.shape[-1])
        go8_1, go_scale_1 = _cast(go, r.grad_dtype, 0 if r.rowwise else None, r.power_of_2)
        x8_1, x_scale_1 = _cast(x, torch.float8_e4m3fn, 0 if r.rowwise else None, r.power_of_2)
        grad_weight = _scaled_mm(go8_1.t(), go_scale_1.t(), x8_1, x_scale_1, grad_output.dtype)
        return grad_input, grad_weight.t(), None


class Float8Linear(nn.Linear):
    """`nn.Linear` trained in float8 by torchao's rules (the stand-in for its `Float8Linear`)."""

    def __init__(self, linear: nn.Linear, recipe: Float8Recipe) -> None:
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight, self.bias = linear.weight, linear.bias
        self.recipe = recipe

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cuda"):  # torchao repeats F.linear's autocast
            input = input.to(torch.get_autocast_dtype("cuda"))
        output = _Float8Matmul.apply(input, self.weight.t(), self.recipe)
        return output if self.bias is None else output + self.bias.to(output.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}" + (
            ", float8 all-gather" if self.recipe.all_gather else ""
        )


def _torchao_config(recipe: Float8Recipe) -> Any:
    """torchao's `Float8LinearConfig` of `recipe`, or None where torchao does not import."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        return None
    return Float8LinearConfig.from_recipe_name(recipe.name)


#: The linears left in high precision: the output head, as torchtitan's train configs filter it
#: (`filter_fqns = ["output"]`; remat's presets and Hugging Face name it `lm_head`).
SKIPPED = ("output", "lm_head")


def convert_to_float8(model: nn.Module, recipe: str, skip: tuple[str, ...] = SKIPPED) -> list[str]:
    """Swap every `nn.Linear` of `model` whose in and out features are multiples of 16 and whose
    path contains none of `skip` (torchtitan's `module_filter_fn`) for a float8 one, in place,
    and return their paths. torchao's own `Float8Linear` where torchao imports (its float8
    all-gather lives in FSDP, which a trace does not run: that recipe takes the stand-in, whose
    weight arrives in float8 as FSDP hands it over); the stand-in otherwise."""
    rules = RECIPES[recipe]
    config = None if rules.all_gather else _torchao_config(rules)
    swapped = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or type(child).__name__ == "Float8Linear":
                continue  # torchtitan's own Linear is one; a float8 one (ours, torchao's) is done
            if child.in_features % 16 or child.out_features % 16:
                continue  # torchtitan's module_filter_fn: float8 matmuls need multiples of 16
            where = f"{path}.{name}" if path else name
            if any(s in where for s in skip):
                continue
            if config is not None:
                from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

                swap: nn.Module = TorchaoFloat8Linear.from_float(child, config=config)
            else:
                swap = Float8Linear(child, rules)
            setattr(module, name, swap)
            swapped.append(where)
    return swapped
