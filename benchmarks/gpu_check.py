"""`make gpu-check`: the paths only a GPU takes, run once with real CUDA tensors, one line each.

Every other figure and test runs on CPU. This script runs, on the first CUDA device:

- `resume`: a training job (tests/recover_job.py, dropout drawing from the CUDA generator,
  deterministic kernels, async dumps staged from the GPU) killed by SIGKILL after a dump and
  restarted ends bitwise equal to the same job run through, every loss equal;
- `resume fsdp2`: the same with the model sharded by FSDP2 in a one-rank group (NCCL on CUDA);
- `async dump`: the seconds our async dump blocks the loop, against one device-to-host copy of
  the same state into pinned memory and against `dcp.async_save` (process checkpointer, its
  pinned shared-memory `DefaultStager`, reused where torch allows; blocking until its staging
  completed), then the dump loaded into a fresh model and compared bitwise;
- `throughput` (lines `export`, `dump`): a bf16 HF export through an async Saver, timed until
  durable and the last one loaded back with `from_pretrained` bitwise, and an fp32 + AdamW
  recovery dump, of GPU tensors, in GB/s, against writing the same bytes from host memory to
  one file (buffered) and fsyncing it;
- `peer copies over NCCL`: two processes as two nodes (FSDP2, a tiered trial with
  `local_replicas: 1`), node 1's local tier deleted, the restart assembled from node 0's
  copies over NCCL and compared bitwise. NCCL refuses two ranks on one GPU: on a machine with
  one, the line says so (NOT RUN) rather than passing.

Each check prints `PASS`, `FAIL` or `NOT RUN`, what ran and its figures. Exit status: 0 when no
check failed, 1 when one did, 2 without a CUDA device (nothing is checked; never a silent
pass). `--rehearse-on-cpu` runs the same checks on CPU tensors and gloo, to test this script
where there is no GPU (the suite does: tests/test_gpu_check.py); its figures are not GPU figures
and it says so. `--out` puts the lines, the date, the card and the commit between the result
markers of a Markdown file, keeping the rest (GPU runs only); `--only` runs the named checks.

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
RESULTS_BEGIN, RESULTS_END = "<!-- gpu-check results -->", "<!-- end of gpu-check results -->"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_checks(device: str, mib: int, rounds: int, only: list[str] | None = None) -> list[Line]:
    """Every check in order (those named in ``only``, when given), each in its own scratch
    folder; one that raises is a FAIL naming why."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    checks: list[tuple[str, Callable[[Path], Line | list[Line]]]] = [
        ("resume", lambda work: check_resume(device, work)),
        ("resume fsdp2", lambda work: check_resume(device, work, "fsdp2")),
        ("async dump", lambda work: check_async(device, mib, rounds, work)),
        ("throughput", lambda work: check_throughput(device, mib, rounds, work)),
        ("peer copies", lambda work: check_fill(device, work)),
    ]
    unknown = set(only or []) - {name for name, _ in checks}
    if unknown:
        raise SystemExit(f"gpu-check: no check named {sorted(unknown)}; the checks: {[name for name, _ in checks]}")
    lines: list[Line] = []
    for name, check in checks:
        if only and name not in only:
            continue
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
    parser.add_argument("--only", default=None, help="comma-separated checks to run (default: all)")
    parser.add_argument("--commit", default=None, help="the commit to report (default: git's HEAD, where git is)")
    args = parser.parse_args(argv)
    if not args.rehearse_on_cpu and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}): nothing was checked", flush=True)
        return 2
    device = "cpu" if args.rehearse_on_cpu else "cuda"
    card = "CPU rehearsal" if device == "cpu" else torch.cuda.get_device_name(0)
    commit = args.commit or _commit()
    print(f"gpu-check on {card}, torch {torch.__version__}, commit {commit}", flush=True)
    lines = run_checks(device, args.size, args.rounds, args.only.split(",") if args.only else None)
    failed = sum(line.verdict == "FAIL" for line in lines)
    summary = f"gpu-check: {sum(line.verdict == 'PASS' for line in lines)} passed, {failed} failed, "
    summary += f"{sum(line.verdict == 'NOT RUN' for line in lines)} not run"
    if device == "cpu":
        summary += " (a rehearsal on CPU: these are not GPU results)"
    print(summary, flush=True)
    if args.out and device == "cuda":
        body = "\n".join(f"- `{line}`" for line in lines)
        run = f"Run {datetime.date.today()} on {card}, torch {torch.__version__}, commit {commit}; "
        write_results(Path(args.out), f"{run}{args.size} MiB models, {args.rounds} rounds.\n\n{body}\n\n{summary}")
    return 1 if failed else 0


def write_results(path: Path, results: str) -> None:
    """Put ``results`` between the file's RESULTS markers, keeping the text around them (the
    method, earlier findings); a file without them gets a title, the markers and the results."""
    text = path.read_text() if path.exists() else ""
    if RESULTS_BEGIN in text and RESULTS_END in text:
        before, rest = text.split(RESULTS_BEGIN, 1)
        after = rest.split(RESULTS_END, 1)[1]
    else:
        before, after = (text or "# GPU truth (`make gpu-check`)\n\n"), "\n"
    path.write_text(f"{before}{RESULTS_BEGIN}\n{results}\n{RESULTS_END}{after}")


if __name__ == "__main__":
    sys.exit(main())
