"""`python -m remat ...`: the same CLI as the `remat` script, for environments where the script is
not on PATH (a notebook's kernel, `python -m cProfile -m remat fit ...`)."""

from remat.answers.cli import run

run()
