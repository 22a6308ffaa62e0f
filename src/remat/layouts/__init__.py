"""Layouts past one GPU: one rank's step under tensor, sequence and context parallelism and FSDP
(`parallel`), pipeline stages and their ranks (`pipeline`, its parts in `pipeline_*`), and the
pipeline rows of `remat fit` (`fit_pipeline`). Imports every stage up to `planning`, and
`models`."""
