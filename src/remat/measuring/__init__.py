"""Measuring: the independent ground truth of a real step (saved-tensor hooks, allocator events, the
device's clock, calibration). Shares no code with prediction or planning; imports the base,
`device` and `tracing` (the loss convention, random draws)."""
