"""remat.auto on diffusers models (issue 33): a UNet, a DiT and a VAE trained as users train them
(`remat.models.diffusion`). diffusers calls every block with keywords only and returns
`BaseOutput`s, which regions must pass on as the model does.

For each, at three budgets (100%, halfway, the lowest feasible): gradients bit-identical to the
run without remat, every kept op matched, bytes held for the backward within 2% of the plan and
the peak within 3%. And the acceptance case: the UNet trained as Stable Diffusion is, three AdamW
steps under `auto`, with losses bit-identical to the unplanned UNet's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.answers.bench import gradients

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from diffusers import DDPMScheduler  # noqa: E402

from remat.models.diffusion import (  # noqa: E402
    MODELS,
    build_for_training,
    stable_diffusion_batch,
    tiny_text_encoder,
    tiny_unet,
)


def _check(model, plan, inputs, loss_fn, reference) -> None:
    got = gradients(model, (), loss_fn=loss_fn, **inputs)
    assert got.keys() == reference.keys()
    for name, g in reference.items():
        assert torch.equal(got[name], g), (plan.strategy, name)
    v = remat.verify(model, loss_fn=loss_fn, **inputs)
    assert v.kept_ops_matched == v.kept_ops_expected, [r.missing for r in v.regions]
    assert v.held_ratio == pytest.approx(1, abs=0.02), (plan.strategy, v)
    assert v.peak_ratio == pytest.approx(1, abs=0.03), (plan.strategy, v)
    assert v.ok


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_auto_on_diffusers_models_at_three_budgets(name):
    model, inputs, loss_fn = build_for_training(name)
    reference = gradients(model, (), loss_fn=loss_fn, **inputs)
    first = remat.auto(model, budget="100%", loss_fn=loss_fn, **inputs)
    _check(model, first, inputs, loss_fn, reference)
    remat.remove(model)

    graph = remat.trace(model, loss_fn=loss_fn, **inputs)
    with pytest.raises(remat.InfeasibleBudget) as infeasible:
        remat.plan(graph, budget=1)
    lowest = infeasible.value.min_feasible_bytes
    for budget in ((lowest + first.predicted_peak_bytes) // 2, lowest):
        plan = remat.plan(graph, budget=budget, strategy="auto")
        assert plan.predicted_peak_bytes <= budget
        remat.apply(model, plan)
        _check(model, plan, inputs, loss_fn, reference)
        remat.remove(model)
    assert plan.regions, "the lowest feasible budget needs recomputation"
    assert not [m for m in model.modules() if "forward" in vars(m)]


def _train(unet, batches, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    losses = []
    for noisy, timesteps, states, noise in batches[:steps]:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(unet(noisy, timesteps, states).sample, noise)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.slow
def test_stable_diffusion_training_under_auto_has_the_unplanned_unets_losses():
    """The acceptance case of issue 33: before, the first step raised `TypeError:
    _RegionForward.run() missing 1 required positional argument: 'x'`."""
    text_encoder, scheduler = tiny_text_encoder(), DDPMScheduler()
    generator = torch.Generator().manual_seed(1)
    batches = [
        stable_diffusion_batch(text_encoder, scheduler, generator=generator) for _ in range(3)
    ]
    torch.manual_seed(0)
    unet = tiny_unet().train()
    twin = copy.deepcopy(unet)
    noisy, timesteps, states, noise = batches[0]

    def loss_fn(out):
        return F.mse_loss(out.sample, noise)

    with pytest.raises(remat.InfeasibleBudget) as infeasible:
        remat.auto(unet, noisy, timesteps, states, budget=1, loss_fn=loss_fn)
    lowest = infeasible.value.min_feasible_bytes
    plan = remat.auto(unet, noisy, timesteps, states, budget=lowest, loss_fn=loss_fn)
    assert plan.regions, "the lowest feasible budget needs recomputation"
    planned = _train(unet, batches, 3)
    remat.remove(unet)
    unplanned = _train(twin, batches, 3)
    assert all(torch.equal(a, b) for a, b in zip(planned, unplanned, strict=True)), (
        planned,
        unplanned,
    )
    for (name, p), q in zip(unet.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
