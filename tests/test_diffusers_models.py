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
from planned_steps import sweep_three_budgets

import remat

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


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_auto_on_diffusers_models_at_three_budgets(name):
    model, inputs, loss_fn = build_for_training(name)
    sweep_three_budgets(model, loss_fn=loss_fn, **inputs)


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
