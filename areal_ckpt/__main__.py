"""`python -m areal_ckpt` runs the `areal-ckpt` command line."""

import sys

from areal_ckpt.cli.main import main

sys.exit(main())
