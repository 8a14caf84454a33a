"""`python -m areal_ckpt` runs the `areal-ckpt` command line."""

import sys

from areal_ckpt.tools.cli import main

sys.exit(main())
