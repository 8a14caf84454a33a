"""`make bench` (second part): what an asynchronous save costs the training loop.

For a model-shaped state (see bench.py) it measures, in interleaved rounds:

- one in-memory copy of the state into preallocated memory (the unavoidable cost of a snapshot);
- the blocking time of an async recovery dump and of an async export (`dump` / `save` return
  after staging; the previous save is collected before timing, as a loop with saves far apart
  would find it), and the synchronous dump for comparison. Each is divided by the copy timed
  in the same round, and the target is checked on the median of those ratios: the copy itself
  moved by 2x and more between rounds here;
- a compute-bound loop (matrix products on torch's default threads) alone and while a
  background dump is being written: the slowdown the loop notices.

    python benchmarks/bench_async.py --sizes 256 1024 --rounds 5 --out docs/benchmarks-async.md
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import bench_peers
import torch
from common import machine_description, model_of_size, scratch_folder, state_bytes

import areal_ckpt as ac

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1)
BLOCKING_TARGET = 1.5  # blocking time <= 1.5x one in-memory copy
SLOWDOWN_TARGET = 1.2  # compute loop <= 20% slower during a background write


def copy_seconds(model: torch.nn.Module) -> float:
    """One copy of every state tensor into memory allocated (and touched) beforehand."""
    state = model.state_dict()
    targets = {name: torch.empty_like(t) for name, t in state.items()}
    for target in targets.values():
        target.zero_()
    start = time.perf_counter()
    for name, tensor in state.items():
        targets[name].copy_(tensor)
    return time.perf_counter() - start


def step_info(step: int) -> ac.StepInfo:
    return ac.StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6)


class ComputeLoop:
    """A compute-bound 'training step': products of 768 x 768 matrices, about 0.1 s here."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(768, 768, generator=generator)
        self.b = torch.randn(768, 768, generator=generator)

    def step(self) -> float:
        start = time.perf_counter()
        for _ in range(8):
            self.a = torch.tanh(self.a @ self.b)
        return time.perf_counter() - start


def run(sizes: list[int], rounds: int, dtype: torch.dtype, workdir: Path) -> list[dict]:
    results = []
    loop = ComputeLoop()
    for mib in sizes:
        model = model_of_size(mib, dtype)
        engine = ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))  # model only
        root = Path(tempfile.mkdtemp(dir=workdir))
        names = dict(experiment_name="bench", fileroot=str(root), user="bench", freq_steps=1)
        dumper = ac.RecoverHandler(ac.RecoverConfig(trial_name="async", mode="async", **names), SPEC)
        sync_dumper = ac.RecoverHandler(ac.RecoverConfig(trial_name="sync", mode="sync", **names), SPEC)
        exporter = ac.Saver(ac.SaverConfig(trial_name="export", mode="async", keep_last=1, **names), SPEC)
        dumper.dump(engine, step_info(0), force=True)  # starts the writers; not timed
        exporter.save(engine, 0, 0, 0, force=True)
        timings: dict[str, list[float]] = {k: [] for k in ("copy", "dump", "export", "sync dump", "alone", "during")}
        for round_index in range(1, rounds + 1):
            gc.collect()
            timings["copy"].append(copy_seconds(model))
            dumper.wait()
            start = time.perf_counter()
            dumper.dump(engine, step_info(round_index), force=True)
            timings["dump"].append(time.perf_counter() - start)
            while dumper.saving_in_background:
                timings["during"].append(loop.step())
            dumper.wait()
            timings["alone"] += [loop.step() for _ in range(max(3, len(timings["during"])))]
            exporter.wait()
            start = time.perf_counter()
            exporter.save(engine, 0, round_index, round_index, force=True)
            timings["export"].append(time.perf_counter() - start)
            exporter.wait()
            start = time.perf_counter()
            sync_dumper.dump(engine, step_info(round_index), force=True)
            timings["sync dump"].append(time.perf_counter() - start)
            print(f"  {mib} MiB: round {round_index}/{rounds} done", file=sys.stderr, flush=True)
        background = dumper.last_metrics["time/background"]
        for handler in (dumper, sync_dumper):
            handler.close()
        exporter.finalize()
        shutil.rmtree(root)
        results.append(
            {
                "mib": mib,
                "bytes": state_bytes(model),
                "background": background,
                "steps_during": len(timings["during"]),
                **{name: statistics.median(values) if values else float("nan") for name, values in timings.items()},
                **{
                    f"{name} / copy": statistics.median(t / c for t, c in zip(timings[name], timings["copy"]))
                    for name in ("dump", "export")
                },
            }
        )
        del model, engine
    return results


def report(results: list[dict], machine: str, dtype: torch.dtype) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}; {str(dtype).removeprefix('torch.')} state, "
        "model only; medians of interleaved rounds; a blocking time's ratio is the median over rounds "
        "of its time over the copy timed in the same round.",
        "",
    ]
    for r in results:
        lines += [
            f"### {r['bytes'] / 2**20:.0f} MiB of state",
            "",
            "| measurement | seconds |",
            "| --- | --- |",
            f"| one in-memory copy of the state | {r['copy']:.3f} |",
            f"| async recovery dump, blocking | {r['dump']:.3f} |",
            f"| async export, blocking | {r['export']:.3f} |",
            f"| sync recovery dump (durable), for comparison | {r['sync dump']:.3f} |",
            f"| async dump, background write + commit (last round) | {r['background']:.3f} |",
            f"| compute step alone | {r['alone']:.3f} |",
            f"| compute step during a background write ({r['steps_during']} steps) | {r['during']:.3f} |",
            "",
            "| target | measured | verdict |",
            "| --- | --- | --- |",
        ]
        for label, ratio, limit in (
            (f"async dump blocks <= {BLOCKING_TARGET}x one copy", r["dump / copy"], BLOCKING_TARGET),
            (f"async export blocks <= {BLOCKING_TARGET}x one copy", r["export / copy"], BLOCKING_TARGET),
            (
                f"compute loop slows <= {SLOWDOWN_TARGET:.1f}x during the write",
                r["during"] / r["alone"],
                SLOWDOWN_TARGET,
            ),
        ):
            lines.append(f"| {label} | {ratio:.2f}x | {'PASS' if ratio <= limit else 'FAIL'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="state sizes in MiB (fp32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument(
        "--peer-rounds", type=int, default=7, help="rounds of the comparison with torch's async_save (0: skip it)"
    )
    args = parser.parse_args(argv)
    workdir = scratch_folder("bench-async-")
    try:
        results = run(args.sizes, args.rounds, getattr(torch, args.dtype), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, machine_description(), getattr(torch, args.dtype))
    if args.peer_rounds:
        text += "\n## Beside torch's own async save and load\n\n" + bench_peers.measure(args.peer_rounds) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(
            f"# Benchmarks: asynchronous saves\n\nRerun: `make bench` (or "
            f"`python benchmarks/bench_async.py --help`).\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
