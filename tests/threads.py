"""The one thread setting of every process the suite starts.

A run with one intra-op thread and a run with two differ in the last bits from the first matmul
(the reduction order changes), so a test that compares bits across processes must not inherit
the machine's default: torch picks 1 on some machines of our kind and 2 on others, and torchrun
sets 1 by itself. :func:`pin` fixes the count in this process's environment, which every child
inherits (fork-server workers, torchrun and its ranks, plain subprocesses), and in torch itself
when it is already imported. conftest.py calls it before torch is imported; distributed.py calls
it for the scripts that start processes without pytest (`make torture`).
"""

from __future__ import annotations

import os
import sys

THREADS = 1
ENVIRONMENT = {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}


def pin() -> None:
    """Give this process and every process it starts ``THREADS`` intra-op threads."""
    os.environ.update(ENVIRONMENT)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(THREADS)
