"""`make bench` (fourth part): our DeepSpeed checkpoints against DeepSpeed's own, like for like.

Two gloo ranks train a model-shaped Qwen2 one step under DeepSpeed (CPU, fp32, ZeRO 1 and 3),
then each round saves it both ways into fresh folders, in alternating order:
``areal_ckpt.save_checkpoint`` (durable on return: every file fsync'd, then published) and
DeepSpeed's ``engine.save_checkpoint`` followed by an fsync of every file it wrote (its writer
does not fsync; without it the comparison would time the page cache). Then both are loaded
cold (page cache dropped): ``areal_ckpt.load_checkpoint`` and ``engine.load_checkpoint``. Each
figure is the slowest rank's time; the ratio is DeepSpeed's time over ours, per round (above 1:
ours is faster), reported as the median and the range over the rounds.

    python benchmarks/bench_deepspeed.py --size 160 --rounds 5 --out docs/benchmarks-deepspeed.md
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
    fsync_tree,
    machine_description,
    model_of_size,
    publish,
    scratch_folder,
    size_and_rounds,
    state_bytes,
    zero_engine,
)

import areal_ckpt as ac  # noqa: E402
from areal_ckpt.formats import cache_fill  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _timed(action) -> float:
    torch_dist.barrier()
    start = time.perf_counter()
    action()
    torch_dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX)
    return float(elapsed)


def _worker(rank: int, world: int, port: int, stage: int, mib: int, rounds: int, workdir: str, result: str) -> None:

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    model = model_of_size(mib, torch.float32)
    size = state_bytes(model)
    engine = zero_engine(model, stage)
    tokens = torch.arange(16).reshape(1, 16)
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    work = Path(workdir)
    rows = []
    for index in range(rounds):
        ours, native = work / f"ours-{index}", work / f"native-{index}"
        timings = {}
        order = ("ours", "native") if index % 2 == 0 else ("native", "ours")
        for method in order:
            if method == "ours":
                timings["save ours"] = _timed(lambda: ac.save_checkpoint(engine, ours, tag="t"))
            else:
                timings["save native"] = _timed(
                    lambda: (engine.save_checkpoint(str(native), tag="t"), rank == 0 and fsync_tree(native))
                )
        for folder in (ours, native):
            if rank == 0:
                evict(folder)
        for method in order:
            if method == "ours":
                timings["load ours"] = _timed(lambda: ac.load_checkpoint(engine, ours, tag="t"))
                cache_fill.wait_for_fills()  # its background page-cache fill would slow the native load
            else:
                timings["load native"] = _timed(lambda: engine.load_checkpoint(str(native), tag="t"))
        sizes = {
            name: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for name, folder in (("ours", ours), ("native", native))
        }
        rows.append({"timings": timings, "sizes": sizes})
        torch_dist.barrier()
        if rank == 0:
            shutil.rmtree(ours)
            shutil.rmtree(native)
    if rank == 0:
        Path(result).write_text(json.dumps({"bytes": size, "rows": rows}))
    torch_dist.destroy_process_group()


def measure(stage: int, mib: int, rounds: int) -> dict:
    work = scratch_folder(f"bench-ds{stage}-")
    result = work / "result.json"
    try:
        mp.spawn(_worker, args=(2, free_port(), stage, mib, rounds, str(work), str(result)), nprocs=2, join=True)
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ratio_cell(rows: list[dict], native: str, ours: str) -> str:
    ratios = [row["timings"][native] / row["timings"][ours] for row in rows]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(results: dict[int, dict], mib: int, rounds: int) -> str:
    lines = [
        "# DeepSpeed: our checkpoints against DeepSpeed's own",
        "",
        f"Measured by `benchmarks/bench_deepspeed.py --size {mib} --rounds {rounds}` on {machine_description()}, "
        f"{time.strftime('%Y-%m-%d')}: 2 gloo ranks on CPU, fp32, AdamW, a Qwen2-shaped model of "
        f"{results[min(results)]['bytes'] / 2**20:.0f} MiB of weights (plus two moments in the optimizer).",
        "",
        "Save: `areal_ckpt.save_checkpoint` (fsync'd and published) against DeepSpeed's `engine.save_checkpoint` "
        "followed by an fsync of its files (its own writer does not fsync). Load: both cold (page cache dropped). "
        "Seconds are medians of the slowest rank; the ratio is DeepSpeed's time over ours, per round "
        "(above 1: ours is faster), median and range.",
        "",
        "| ZeRO | save ours (s) | save DeepSpeed + fsync (s) | save ratio | load ours (s) | load DeepSpeed (s) | "
        "load ratio | size ours / DeepSpeed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage, result in sorted(results.items()):
        rows = result["rows"]
        median = {key: statistics.median(row["timings"][key] for row in rows) for key in rows[0]["timings"]}
        sizes = rows[0]["sizes"]
        lines.append(
            f"| {stage} | {median['save ours']:.2f} | {median['save native']:.2f} | "
            f"{_ratio_cell(rows, 'save native', 'save ours')} | {median['load ours']:.2f} | "
            f"{median['load native']:.2f} | {_ratio_cell(rows, 'load native', 'load ours')} | "
            f"{sizes['ours'] / 2**20:.0f} / {sizes['native'] / 2**20:.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = size_and_rounds(__doc__, 160, "MiB of fp32 weights")
    parser.add_argument("--stages", default="1,3")
    args = parser.parse_args(argv)
    results = {int(stage): measure(int(stage), args.size, args.rounds) for stage in args.stages.split(",")}
    return publish(report(results, args.size, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
