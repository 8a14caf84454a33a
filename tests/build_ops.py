"""Build the DeepSpeed ops the suite loads (CPU: shared-memory comm, async I/O, pinned memory)
once, when `make` creates the virtual environment, into the folder tests/distributed.py points
TORCH_EXTENSIONS_DIR at (inside .venv, so a new environment builds them anew). Without this
the first test that needs each op compiles it (about six minutes on 2 cores for all three)."""

from __future__ import annotations

import time

import distributed  # noqa: F401  (sets DS_ACCELERATOR and TORCH_EXTENSIONS_DIR as the tests see them)
from deepspeed.accelerator import get_accelerator

if __name__ == "__main__":
    for name in ("ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if not builder.is_compatible(verbose=False):  # async I/O needs libaio-dev: `make test` installs it
            print(f"{name}: not buildable here yet; the first test that needs it builds it")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"{name}: ready in {time.perf_counter() - start:.0f} s")
