"""`make demo`: run the demo training process under a restarting launcher, as a cluster would.

The first attempt kills itself with SIGKILL part-way (``demo.kill_at_step`` in the config, or
``--kill-at-step``); the launcher restarts it, like ``torchrun --max-restarts``, and the new
process resumes from the last recovery dump by itself. Run it again and it resumes whatever is
left (nothing, once the trial is complete).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo", description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--kill-at-step", type=int, default=None, help="crash the first attempt at this global step")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. saver.freq_steps=5")
    args = parser.parse_args(argv)
    demo = (yaml.safe_load(Path(args.config).read_text()) or {}).get("demo", {})
    kill_at = args.kill_at_step if args.kill_at_step is not None else demo.get("kill_at_step", -1)

    for attempt in range(args.max_restarts + 1):
        command = [sys.executable, "-m", "areal_ckpt.demo.train", "--config", args.config]
        if attempt == 0 and kill_at >= 0:
            command += ["--kill-at-step", str(kill_at)]
        print(f"== launcher: attempt {attempt + 1}: {' '.join(command[1:])}", flush=True)
        code = subprocess.call([*command, *args.overrides])
        if code == 0:
            return 0
        if code == -signal.SIGKILL and attempt < args.max_restarts:
            print("== launcher: the training process was killed (SIGKILL); restarting it", flush=True)
            continue
        print(f"== launcher: training failed with exit code {code}", flush=True)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
