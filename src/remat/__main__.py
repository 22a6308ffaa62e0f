"""`python -m remat ...`: the same CLI as the `remat` script, for environments where the script is
not on PATH (a notebook's kernel, `python -m cProfile -m remat fit ...`)."""

import sys

from remat.answers.cli import main

sys.exit(main())
