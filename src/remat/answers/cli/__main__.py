"""`python -m remat.answers.cli`: the `remat` command (`python -m remat` is the short spelling)."""

from remat.answers.cli import run

run()
