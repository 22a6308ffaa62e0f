"""Applying: a `Plan` onto a live model: eager checkpoint regions and selective policies (`eager`),
the fastest of the plans that fit timed on the model (`tune`), the one-line `auto`, and remat's
partitioner inside torch.compile (`compiled`). Imports every stage below it."""
