"""Where a pipeline stage sits among the stages, apart from how the model was cut, so that every
way of cutting (`pipeline_stages`, `pipeline_hf`) builds on it without importing the others."""

from __future__ import annotations

from torch import nn


class StagePlace(nn.Module):
    """Where a stage sits: its index among `num_stages` and the model's blocks it runs
    (`layer_indices`), shared by every way of cutting a model (`pipeline_stages.Stage`, `pipeline_hf.HFStage`)."""

    def __init__(self, index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.index, self.num_stages, self.layer_indices = index, num_stages, layers

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def extra_repr(self) -> str:
        first, last = self.layer_indices.start, self.layer_indices.stop - 1
        return f"stage {self.index} of {self.num_stages}, blocks {first}..{last}"
