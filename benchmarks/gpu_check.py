"""`make gpu-check`: the paths only a GPU takes, run once with real CUDA tensors, one line each.

Every other figure and test runs on CPU. This script runs, on the first CUDA device:

- `resume`: a training job (tests/recover_job.py, dropout drawing from the CUDA generator,
  deterministic kernels, async dumps staged from the GPU) killed by SIGKILL after a dump and
  restarted ends bitwise equal to the same job run through, every loss equal;
- `async dump`: the seconds our async dump blocks the loop, against one device-to-host copy of
  the same state into pinned memory and against `dcp.async_save` (process checkpointer, its
  pinned shared-memory `DefaultStager` reused; blocking until its staging completed), then the
  dump loaded into a fresh model and compared bitwise;
- `export`, `dump`: a bf16 HF export and an fp32 + AdamW recovery dump of GPU tensors, in GB/s,
  against writing the same bytes from host memory to one file (buffered) and fsyncing it;
- `peer copies over NCCL`: two processes as two nodes (FSDP2, a tiered trial with
  `local_replicas: 1`), node 1's local tier deleted, the restart assembled from node 0's
  copies over NCCL and compared bitwise. NCCL refuses two ranks on one GPU: on a machine with
  one, the line says so (NOT RUN) rather than passing.

Each check prints `PASS`, `FAIL` or `NOT RUN`, what ran and its figures. Exit status: 0 when no
check failed, 1 when one did, 2 without a CUDA device (nothing is checked; never a silent
pass). `--rehearse-on-cpu` runs the same checks on CPU tensors and gloo, to test this script
where there is no GPU (the suite does: tests/test_gpu_check.py); its figures are not GPU figures
and it says so. `--out` writes the lines, the date, the card and the commit to a Markdown file
(GPU runs only).

    python benchmarks/gpu_check.py --out docs/benchmarks-gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as torch_dist
from common import scratch_folder
from gpu_checks import Line, check_async, check_fill, check_resume, check_throughput, free_port

HERE = Path(__file__).resolve().parent


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_checks(device: str, mib: int, rounds: int) -> list[Line]:
    """Every check in order, each in its own scratch folder; one that raises is a FAIL naming why."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    checks: list[tuple[str, Callable[[Path], Line | list[Line]]]] = [
        ("resume", lambda work: check_resume(device, work)),
        ("resume fsdp2", lambda work: check_resume(device, work, "fsdp2")),
        ("async dump", lambda work: check_async(device, mib, rounds, work)),
        ("export, dump", lambda work: check_throughput(device, mib, rounds, work)),
        ("peer copies", lambda work: check_fill(device, work)),
    ]
    lines: list[Line] = []
    for name, check in checks:
        work = scratch_folder("gpu-check-")
        try:
            found = check(work)
            for line in found if isinstance(found, list) else [found]:
                lines.append(line)
                print(line, flush=True)
        except Exception as error:
            line = Line("FAIL", name, f"{type(error).__name__}: {error}"[:600])
            lines.append(line)
            print(line, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size", type=int, default=256, help="MiB of weights of the timed models (fp32: ~3x with AdamW)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--rehearse-on-cpu", action="store_true", help="the same checks on CPU tensors (not GPU figures)"
    )
    parser.add_argument("--out", default=None, help="write the lines to this Markdown file (GPU runs only)")
    parser.add_argument("--commit", default=None, help="the commit to report (default: git's HEAD, where git is)")
    args = parser.parse_args(argv)
    if not args.rehearse_on_cpu and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}): nothing was checked", flush=True)
        return 2
    device = "cpu" if args.rehearse_on_cpu else "cuda"
    card = "CPU rehearsal" if device == "cpu" else torch.cuda.get_device_name(0)
    commit = args.commit or _commit()
    print(f"gpu-check on {card}, torch {torch.__version__}, commit {commit}", flush=True)
    lines = run_checks(device, args.size, args.rounds)
    failed = sum(line.verdict == "FAIL" for line in lines)
    summary = f"gpu-check: {sum(line.verdict == 'PASS' for line in lines)} passed, {failed} failed, "
    summary += f"{sum(line.verdict == 'NOT RUN' for line in lines)} not run"
    if device == "cpu":
        summary += " (a rehearsal on CPU: these are not GPU results)"
    print(summary, flush=True)
    if args.out and device == "cuda":
        body = "\n".join(f"- `{line}`" for line in lines)
        Path(args.out).write_text(
            f"# GPU truth (`make gpu-check`)\n\nRun {datetime.date.today()} on {card}, torch {torch.__version__}, "
            f"commit {commit}; {args.size} MiB models, {args.rounds} rounds.\n\n{body}\n\n{summary}\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
