"""`python -m areal_ckpt.demo`: the demo job under `areal-ckpt launch`, as `make demo` runs it.

The first attempt kills itself with SIGKILL part-way (``demo.kill_at_step`` in the config, or
``--kill-at-step``); the launcher relaunches it (``recover.retries``) and the new process resumes
from the last recovery dump by itself. Run it again and it resumes whatever is left (nothing,
once the trial is complete).
"""

from __future__ import annotations

import argparse
import sys

from areal_ckpt.config_loader import load_config
from areal_ckpt.tools.launch import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo", description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--kill-at-step", type=int, default=None, help="crash the first attempt at this global step")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. saver.freq_steps=5")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "areal_ckpt.demo.train", "--config", args.config]
    if args.kill_at_step is not None:
        command += ["--kill-at-step", str(args.kill_at_step)]
    return launch(load_config(args.config, args.overrides).recover, [*command, *args.overrides])


if __name__ == "__main__":
    sys.exit(main())
