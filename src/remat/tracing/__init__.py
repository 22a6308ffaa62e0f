"""Tracing: one training step of a model recorded on fake (or real CPU) tensors as a `Graph`, every
aten op of forward and backward with what autograd saves. Imports the base and `device`."""
