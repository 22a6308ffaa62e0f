"""`python -m remat.answers.cli`: the `remat` command."""

import sys

from remat.answers.cli import main

sys.exit(main())
