"""Ground-truth measurement against byte counts worked out by hand.

Every expected number below is written as arithmetic over shapes: 4 bytes per float32 element.
"""

from __future__ import annotations

import weakref
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.errors import RematError
from remat.measuring.measure import Measurement, measure, saved_tensor_bytes

F32 = 4


def mlp(d_in: int = 64, hidden: int = 128, d_out: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, d_out),
    )


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_activation_bytes_count_linear_input_and_relu_output_exactly() -> None:
    x = torch.randn(32, 64)
    # Linear saves its input x (its weight is a parameter), ReLU saves its output.
    expected = 32 * 64 * F32 + 32 * 128 * F32
    assert saved_tensor_bytes(LinearRelu(), x) == expected
    assert measure(LinearRelu(), x).activation_bytes == expected


class Aliasing(nn.Module):
    """Saves one storage through a view, an in-place op and the same tensor used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(32, 2, 64)
        h.relu_()  # saves its result: the storage of the linear's output
        return h * h.view(32, 128).view(32, 2, 64)  # saves both operands: that storage again


def test_views_in_place_and_reuse_count_a_storage_once() -> None:
    x = torch.randn(32, 64)
    assert saved_tensor_bytes(Aliasing(), x) == 32 * 64 * F32 + 32 * 128 * F32


class ScaledByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128, bias=False)
        self.register_buffer("scale", torch.full((128,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale).relu()


def test_parameters_and_buffers_are_not_activation_bytes() -> None:
    # With x requiring grad, mm saves the weight and mul saves the buffer; neither counts.
    x = torch.randn(32, 64, requires_grad=True)
    assert saved_tensor_bytes(ScaledByBuffer(), x) == 32 * 64 * F32 + 32 * 128 * F32


class DiscardedBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x).relu()  # saved, then freed with its unused graph; the address may be reused
        return self.lin(x).relu()


def test_a_storage_freed_during_forward_and_a_later_one_both_count() -> None:
    x = torch.randn(32, 64)
    assert saved_tensor_bytes(DiscardedBranch(), x) == 32 * 64 * F32 + 2 * 32 * 128 * F32


class RemembersOutput(LinearRelu):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.output = weakref.ref(out.untyped_storage())
        return out


def test_saved_tensor_bytes_leaves_no_graph_alive() -> None:
    # ReLU saves its own output; a pack hook returning that tensor would leak it in a cycle.
    model = RemembersOutput()
    saved_tensor_bytes(model, torch.randn(32, 64))
    assert model.output() is None


def test_mlp_baseline_saved_and_retained_match_shapes() -> None:
    batch, model = 32, mlp()
    m = measure(model, torch.randn(batch, 64))
    x, act, out, loss = batch * 64 * F32, batch * 128 * F32, batch * 16 * F32, F32
    assert m.baseline_bytes == param_bytes(model) + x
    assert m.activation_bytes == x + 2 * act  # the input and both ReLU outputs
    assert m.held_bytes == 2 * act + out + loss  # the input existed before the step
    assert m.held_bytes >= m.activation_bytes - x


class DropsAnOldTensor(LinearRelu):
    """Lets go of a tensor made before the step, in its forward (a cache replaced, say)."""

    def __init__(self, old: torch.Tensor) -> None:
        super().__init__()
        self.old = [old]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.old.clear()
        return super().forward(x)


def test_a_storage_older_than_the_step_freed_in_it_is_not_subtracted() -> None:
    """c10's CPU reporter keeps the size of every block allocated while a profiler ran and
    reports its free under a later profiler: freeing, in the measured step, a tensor made during
    an earlier profiled step took its bytes off the step's (held 0.94 of the plan's on a tiny
    Mistral after other measured steps in one process). Only what the step allocated counts."""
    x = torch.randn(32, 64)
    held = 32 * 128 * F32 + F32  # the ReLU output (also the output) and the loss
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ):
        old = torch.empty(64 * 1024, dtype=torch.uint8)  # its size is now in the reporter's table
    model = DropsAnOldTensor(old)
    del old  # the model's list holds it alone: its forward frees it
    profiled_then = measure(model, x, warmup=0)
    never_profiled = measure(
        DropsAnOldTensor(torch.empty(64 * 1024, dtype=torch.uint8)), x, warmup=0
    )
    assert profiled_then.held_bytes == never_profiled.held_bytes == held
    assert profiled_then.peak_bytes == never_profiled.peak_bytes


def test_mlp_peak_is_activations_plus_backward_transient() -> None:
    # At batch 256 activations dominate and the peak is inside the second ReLU's backward. Live
    # then, above the baseline: what forward retained (both ReLU outputs, the output, the loss),
    # the loss gradient, the last layer's weight and bias gradients, and the two (batch, 128)
    # gradients of ReLU's backward: the one it reads and the one it writes.
    batch, model = 256, mlp()
    m = measure(model, torch.randn(batch, 64))
    act = batch * 128 * F32
    retained = 2 * act + batch * 16 * F32 + F32
    assert m.held_bytes == retained
    expected = m.baseline_bytes + retained + F32 + (16 * 128 + 16) * F32 + 2 * act
    # Lower bound: all of that must coexist. Slack: kernel temporaries allocated through torch;
    # the largest in this step is mm's contiguous copy of the expanded (batch, 16) gradient.
    assert expected <= m.peak_bytes <= expected + batch * 16 * F32


def test_peak_grows_linearly_with_batch() -> None:
    # Batches where the same point of the step is the peak (activation-dominated, see above).
    above = [
        m.peak_bytes - m.baseline_bytes
        for m in (measure(mlp(), torch.randn(b, 64)) for b in (256, 512, 1024))
    ]
    assert above[2] - above[1] == 2 * (above[1] - above[0])
    # Per batch row: two ReLU outputs, one output row, the two gradients of ReLU's backward.
    assert above[1] - above[0] == 256 * (2 * 128 + 16 + 2 * 128) * F32


def test_adamw_state_raises_peak_by_at_least_twice_the_parameters() -> None:
    x = torch.randn(32, 64)
    plain, adamw = measure(mlp(), x), measure(mlp(), x, optimizer="adamw")
    assert adamw.peak_bytes - plain.peak_bytes >= 2 * param_bytes(mlp())
    # exp_avg and exp_avg_sq per parameter, plus one float32 `step` scalar per parameter.
    assert adamw.baseline_bytes - plain.baseline_bytes == 2 * param_bytes(mlp()) + 6 * F32


def test_optimizer_state_created_inside_the_step_counts_in_peak_not_baseline() -> None:
    x = torch.randn(32, 64)
    m = measure(mlp(), x, optimizer="adamw", warmup=0)
    assert m.baseline_bytes == param_bytes(mlp()) + x.numel() * F32
    assert m.peak_bytes - m.baseline_bytes >= 2 * param_bytes(mlp())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class FlatParameters(nn.Module):
    """Two parameters that are views of one flat storage, as in FSDP's flat parameters."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.randn(2 * 16 * 16)
        self.a = nn.Parameter(flat[: 16 * 16].view(16, 16))
        self.b = nn.Parameter(flat[16 * 16 :].view(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a @ self.b


def test_tied_and_shared_storage_weights_count_once_in_baseline() -> None:
    x = torch.randn(4, 16)
    assert measure(Tied(), x).baseline_bytes == 16 * 16 * F32 + x.numel() * F32
    assert measure(FlatParameters(), x).baseline_bytes == 2 * 16 * 16 * F32 + x.numel() * F32


def test_same_input_passed_twice_counts_once_in_baseline() -> None:
    class Add(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a + b)

    x = torch.randn(4, 8)
    assert measure(Add(), x, b=x).baseline_bytes == 8 * 8 * F32 + x.numel() * F32


Pair = namedtuple("Pair", ["a", "b"])


def test_structured_inputs_reach_the_model_with_their_types() -> None:
    class Structured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)

        def forward(self, pair: Pair, extra: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.lin(pair.a * pair.b + extra["c"])

    x = torch.randn(4, 8)
    m = measure(Structured(), Pair(x, x.clone()), extra={"c": x.clone()}, device="cpu")
    assert m.baseline_bytes == 8 * 8 * F32 + 3 * x.numel() * F32


class CheckpointedMiddle(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.middle = nn.Sequential(
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
        )
        self.last = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.use_checkpoint:
            h = checkpoint(self.middle, h, use_reentrant=False)
        else:
            h = self.middle(h)
        return self.last(h)


def test_checkpoint_lowers_held_bytes() -> None:
    x = torch.randn(32, 64)
    plain = measure(CheckpointedMiddle(False), x)
    ckpt = measure(CheckpointedMiddle(True), x)
    act = 32 * 128 * F32
    # The middle block keeps only its output (saved by the last layer): two of its three ReLU
    # outputs go. Checkpoint keeps the block's input (the first ReLU output, kept anyway) and a
    # snapshot of the CPU generator state, to replay dropout the same way when it recomputes.
    rng_state = torch.get_rng_state().nbytes
    assert ckpt.held_bytes == plain.held_bytes - 2 * act + rng_state
    # Inner saves go through checkpoint's own hooks: activation_bytes does not see them at all.
    assert ckpt.activation_bytes == plain.activation_bytes - 2 * act


def test_default_loss_reaches_every_floating_output() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 4)
            self.b = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"a": self.a(x), "rest": (self.b(x), torch.arange(3))}

    model = TwoHeads()
    before = [p.detach().clone() for p in model.parameters()]
    measure(model, torch.randn(4, 8), optimizer="sgd")
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_model_is_unchanged_without_optimizer_and_grads_end_none() -> None:
    model = mlp()
    x = torch.randn(8, 64, requires_grad=True)
    before = [p.detach().clone() for p in model.parameters()]
    m = measure(model, x, steps=3, warmup=2)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    assert isinstance(m, Measurement) and m.device == "cpu"
    assert len(m.step_seconds) == 3 and all(s > 0 for s in m.step_seconds)


def test_meta_model_raises_asking_for_real_tensors() -> None:
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(RematError, match="real tensors.*device='cpu'"):
        measure(model, torch.randn(2, 4))
    with pytest.raises(RematError, match="real tensors"):
        saved_tensor_bytes(model, torch.randn(2, 4))


def test_unknown_optimizer_names_the_valid_values() -> None:
    with pytest.raises(RematError, match="optimizer='adam'.*'sgd', 'sgd-momentum', 'adamw'"):
        measure(mlp(), torch.randn(2, 64), optimizer="adam")


def test_device_the_model_is_not_on_raises_instead_of_moving_it() -> None:
    model = mlp()
    with pytest.raises(RematError, match="does not move the model"):
        measure(model, torch.randn(2, 64), device="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_output_without_floating_tensor_needs_a_loss_fn() -> None:
    class Argmax(LinearRelu):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).argmax(dim=1)

    with pytest.raises(RematError, match="loss_fn="):
        measure(Argmax(), torch.randn(2, 64))


def test_steps_must_be_positive() -> None:
    with pytest.raises(RematError, match="steps >= 1"):
        measure(mlp(), torch.randn(2, 64), steps=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_agrees_with_cpu_up_to_allocator_rounding() -> None:
    batch = 32
    x = torch.randn(batch, 64)
    cpu = measure(mlp(), x)
    gpu = measure(mlp().cuda(), x.cuda())
    assert gpu.device.startswith("cuda:")
    assert (gpu.activation_bytes, gpu.baseline_bytes) == (cpu.activation_bytes, cpu.baseline_bytes)
    # The caching allocator rounds each block up to 512 bytes: only the 4-byte loss grows here.
    assert gpu.held_bytes == cpu.held_bytes - F32 + 512
