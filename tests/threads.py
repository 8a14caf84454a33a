"""The one thread setting, and the signal dispositions, of every process the suite starts.

A run with one intra-op thread and a run with two differ in the last bits from the first matmul
(the reduction order changes), so a test that compares bits across processes must not inherit
the machine's default: torch picks 1 on some machines of our kind and 2 on others, and torchrun
sets 1 by itself. :func:`pin` fixes the count in this process's environment, which every child
inherits (fork-server workers, torchrun and its ranks, plain subprocesses), and in torch itself
when it is already imported. conftest.py calls it before torch is imported; distributed.py calls
it for the scripts that start processes without pytest (`make torture`).

Signals likewise: a runner started in the background without job control, or under nohup,
hands its children SIGINT / SIGHUP ignored, and an ignored signal stays ignored across fork and
exec (Python then does not even install its KeyboardInterrupt handler). The tests that send
Ctrl-C, SIGHUP or SIGTERM need them delivered, so :func:`pin` gives this process, and so every
process it starts, the default dispositions.
"""

from __future__ import annotations

import os
import signal
import sys

THREADS = 1
ENVIRONMENT = {"OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}


def pin() -> None:
    """Give this process and every process it starts ``THREADS`` intra-op threads and the
    default handling of SIGINT (KeyboardInterrupt), SIGHUP and SIGTERM."""
    os.environ.update(ENVIRONMENT)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(THREADS)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
