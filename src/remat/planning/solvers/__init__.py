"""Planners that choose which activations to keep and which to recompute under a byte budget."""
