"""Prediction: what a traced step holds and when: the eager judge (`schedule`), the step's peak with
the optimizer (`estimate`), the GPU's view through the allocator (`gpu_memory`), torch.compile'd steps
(`compiled_estimate`, `inductor_plan`) and sizes by exact interpolation (`sizes`). Imports the base,
`device` and `tracing`."""
