"""Small diffusers models trained as users train them: the sweep's diffusion family
(tests/test_diffusers_models.py, benchmarks/diffusers_models.py, docs/models.md).

- `unet`: `UNet2DConditionModel` trained as Stable Diffusion is (diffusers'
  `train_text_to_image.py`): latents noised by a `DDPMScheduler`'s `add_noise` at random timesteps,
  a frozen CLIP text encoder's hidden states as `encoder_hidden_states`, MSE between the predicted
  noise (`unet(...).sample`) and the noise. The latents stand for a frozen VAE's (random here).
- `dit`: `DiTTransformer2DModel` (class-conditional), the same noise-prediction loss.
- `vae`: `AutoencoderKL`, reconstruction MSE of `vae(images).sample`.

Each is a tiny config of the architecture (channels 32-64, 16x16 latents) that trains on a CPU
in milliseconds; diffusers calls every block with keywords only, and returns `BaseOutput`s.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import UnknownModelError

MODELS = ("unet", "dit", "vae")

#: What a builder returns: the model (in train mode), the keyword inputs of its call, and the
#: loss of its output.
Training = tuple[nn.Module, dict[str, torch.Tensor], Callable[[Any], torch.Tensor]]


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as err:
        raise UnknownModelError(
            "the diffusion models need Hugging Face diffusers: pip install 'remat[hf]'"
        ) from err
    return diffusers


def tiny_unet() -> nn.Module:
    """Stable Diffusion's UNet at a tiny size: a cross-attention down and up block around plain
    ones, as SD 1.x's layout is, with 32 and 64 channels."""
    return _diffusers().UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def tiny_text_encoder() -> nn.Module:
    """A frozen CLIP text encoder (two layers, width 32) whose states condition the UNet."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
    )
    return CLIPTextModel(config).eval().requires_grad_(False)


def stable_diffusion_batch(
    text_encoder: nn.Module,
    scheduler: Any,
    *,
    batch: int = 2,
    size: int = 16,
    tokens: int = 16,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Stable Diffusion training batch: (noisy latents, timesteps, text states, noise), the
    noise being the UNet's target."""
    latents = torch.randn(batch, 4, size, size, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    steps = scheduler.config.num_train_timesteps
    timesteps = torch.randint(0, steps, (batch,), generator=generator)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    ids = torch.randint(0, text_encoder.config.vocab_size, (batch, tokens), generator=generator)
    with torch.no_grad():
        states = text_encoder(ids)[0]
    return noisy, timesteps, states, noise


def build_for_training(name: str, *, batch: int = 2, size: int = 16, seed: int = 0) -> Training:
    """`name` (one of `MODELS`) built tiny, seeded, in train mode, with one batch of its training
    inputs and its loss."""
    diffusers = _diffusers()
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if name == "unet":
        model = tiny_unet()
        noisy, timesteps, states, noise = stable_diffusion_batch(
            tiny_text_encoder(),
            diffusers.DDPMScheduler(),
            batch=batch,
            size=size,
            generator=generator,
        )
        inputs = {"sample": noisy, "timestep": timesteps, "encoder_hidden_states": states}
        target = noise
    elif name == "dit":
        model = diffusers.DiTTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            num_layers=2,
            sample_size=size,
            patch_size=2,
            norm_num_groups=8,
        )
        latents = torch.randn(batch, 4, size, size, generator=generator)
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, 1000, (batch,), generator=generator)
        noisy = diffusers.DDPMScheduler().add_noise(latents, noise, timesteps)
        labels = torch.randint(0, 1000, (batch,), generator=generator)
        inputs = {"hidden_states": noisy, "timestep": timesteps, "class_labels": labels}
        target = noise
    elif name == "vae":
        model = diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=size,
        )
        images = torch.randn(batch, 3, size, size, generator=generator)
        inputs = {"sample": images}
        target = images
    else:
        raise UnknownModelError(f"no diffusion model {name!r}: one of {', '.join(MODELS)}")

    def loss_fn(out: Any) -> torch.Tensor:
        return F.mse_loss(out.sample, target)

    return model.train(), inputs, loss_fn
