"""`python -m remat.answers.cli`: the `remat` command (`python -m remat` is the short spelling)."""

import sys

from remat.answers.cli import main

sys.exit(main())
