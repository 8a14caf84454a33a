"""`make bench`: a DeepSpeed checkpoint loaded into another layout against the same layout.

Two gloo ranks train a model-shaped Qwen2 one step under DeepSpeed ZeRO-1 (CPU, fp32, AdamW) and
save it once with ``areal_ckpt.save_checkpoint``. Each round then loads that one checkpoint,
cold (page cache dropped), with ``areal_ckpt.load_checkpoint`` into fresh engines on the same
two ranks: ZeRO-1 (its own partitions: read in place) and ZeRO-3 (other partitions: each
parameter's weights scattered, its fp32 master and moments mapped from the saved partitions),
and ZeRO-1 a second time as the control, in an order that alternates by round. Each figure is
the slowest rank's time to load (engines made before the clock starts); the ratio is the
other layout's time over the same layout's, per round (below 1.3 is the goal), reported as the
median and the range; the control row is the same layout against itself.

    python benchmarks/bench_reshard.py --size 160 --rounds 5 --out docs/benchmarks-reshard.md
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".cache/torch_extensions"))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import (  # noqa: E402
    evict,
    free_port,
    machine_description,
    model_of_size,
    publish,
    scratch_folder,
    size_and_rounds,
    zero_engine,
)

import areal_ckpt as ac  # noqa: E402
from areal_ckpt.formats import cache_fill  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _engine(mib: int, stage: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return zero_engine(model_of_size(mib, torch.float32), stage)


def _worker(rank: int, world: int, port: int, task: str, mib: int, folder: str, result: str) -> None:
    """``save``: train one step under ZeRO-1 and save into ``folder``; ``load N``: time a cold
    load of it into a fresh ZeRO-N engine, the slowest rank's seconds written to ``result``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    if task == "save":
        engine = _engine(mib, 1)
        tokens = torch.arange(16).reshape(1, 16)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        ac.save_checkpoint(engine, folder, tag="t")
    else:
        engine = _engine(mib, int(task.split()[1]))
        if rank == 0:
            evict(Path(folder))
        torch_dist.barrier()
        start = time.perf_counter()
        ac.load_checkpoint(engine, folder, tag="t")
        torch_dist.barrier()
        elapsed = torch.tensor([time.perf_counter() - start])
        torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX)
        cache_fill.wait_for_fills()
        if rank == 0:
            Path(result).write_text(json.dumps(float(elapsed)))
    torch_dist.destroy_process_group()


def _run(task: str, mib: int, folder: Path, result: Path) -> float | None:
    mp.spawn(_worker, args=(2, free_port(), task, mib, str(folder), str(result)), nprocs=2, join=True)
    return json.loads(result.read_text()) if task != "save" else None


def measure(mib: int, rounds: int) -> list[dict[str, float]]:
    """Per round, the seconds of each load: ``same`` and ``control`` (ZeRO-1), ``other`` (ZeRO-3)."""
    work = scratch_folder("bench-reshard-")
    try:
        _run("save", mib, work / "ckpt", work / "result.json")
        rows = []
        for index in range(rounds):
            order = ("same", "other", "control") if index % 2 == 0 else ("other", "control", "same")
            row = {}
            for name in order:
                seconds = _run("load 3" if name == "other" else "load 1", mib, work / "ckpt", work / "result.json")
                assert seconds is not None
                row[name] = seconds
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cell(rows: list[dict[str, float]], key: str) -> str:
    ratios = [row[key] / row["same"] for row in rows]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(rows: list[dict[str, float]], mib: int, rounds: int) -> str:
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return "\n".join(
        [
            "# DeepSpeed: a checkpoint loaded into another layout",
            "",
            f"Measured by `benchmarks/bench_reshard.py --size {mib} --rounds {rounds}` on {machine_description()}, "
            f"{time.strftime('%Y-%m-%d')}: 2 gloo ranks on CPU, fp32, AdamW, a Qwen2-shaped model of about "
            f"{mib} MiB of weights, trained one step under ZeRO-1 and saved once with `save_checkpoint`.",
            "",
            "Each round loads that checkpoint cold (page cache dropped) with `load_checkpoint` into fresh engines on "
            "the same 2 ranks: ZeRO-1 (its own partitions, read in place), ZeRO-3 (other partitions: weights "
            "scattered, fp32 masters and Adam moments mapped parameter by parameter from the saved partitions), and "
            "ZeRO-1 again as the control, the order alternating by round. Seconds are medians of the slowest rank; "
            "the ratio is each load's time over the same-layout load's, per round, median and range (goal: the other "
            "layout at most 1.3x).",
            "",
            "| load into | seconds | ratio to the same layout |",
            "| --- | --- | --- |",
            f"| ZeRO-1, the same layout | {median['same']:.2f} | 1.00x |",
            f"| ZeRO-3, another layout | {median['other']:.2f} | {_cell(rows, 'other')} |",
            f"| ZeRO-1 again (control) | {median['control']:.2f} | {_cell(rows, 'control')} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = size_and_rounds(__doc__, 160, "MiB of fp32 weights").parse_args(argv)
    return publish(report(measure(args.size, args.rounds), args.size, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
