"""`make bench` (third part): two ranks on one disk against one rank, and export memory per rank.

The same model-shaped state (see bench.py) is dumped (RecoverHandler, model only) and exported
(Saver) by one process, and by two gloo processes with the model sharded by FSDP2. Aggregate
throughput is the state's bytes over the slowest rank's time. Configurations alternate
(1, 2, 1, 2, ...) because disk speed drifts. During the 2-rank export each rank's peak extra
resident memory (beyond its own shard, already resident) is compared with one
``max_shard_size`` buffer, the issue's budget (the export holds at most two gathered tensors
at a time: the one it writes and the one being gathered for a peer). The 2-rank run also times
the export's gathers alone (every tensor all-gathered, nothing written): the floor the
network (here gloo over loopback) puts under the export.

    python benchmarks/bench_multirank.py --size 1024 --rounds 3 --out docs/benchmarks-multirank.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

import areal_ckpt as ac
from bench import PeakRss, machine_description, model_of_size, scratch_folder, state_bytes

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1)
SHARD_SIZE = 256 * 2**20
AGGREGATE_TARGET = 0.9


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step(step: int) -> ac.StepInfo:
    return ac.StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6)


def _worker(rank: int, world: int, port: int, mib: int, rounds: int, workdir: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    model = model_of_size(mib, torch.float32)
    size = state_bytes(model)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    engine = ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    names = dict(experiment_name="bench", fileroot=workdir, user="bench", trial_name=f"w{world}")
    handler = ac.RecoverHandler(ac.RecoverConfig(mode="sync", **names), SPEC)
    saver = ac.Saver(ac.SaverConfig(mode="sync", keep_last=1, max_shard_size=SHARD_SIZE, **names), SPEC)
    timings: dict[str, list[float]] = {"dump": [], "export": [], "gather": []}
    tensor_names = [spec.name for spec in engine.export_specs()]
    peak_export = 0
    for index in range(rounds):
        torch_dist.barrier()
        start = time.perf_counter()
        handler.dump(engine, _step(index), force=True)
        timings["dump"].append(time.perf_counter() - start)
        torch_dist.barrier()
        with PeakRss() as rss:
            start = time.perf_counter()
            saver.save(engine, 0, index, index, force=True)
            timings["export"].append(time.perf_counter() - start)
        peak_export = max(peak_export, rss.extra)
        torch_dist.barrier()
        start = time.perf_counter()
        for _ in engine.gather_full(tensor_names, set()):  # what the export's gathers cost without the disk
            pass
        timings["gather"].append(time.perf_counter() - start)
    handler.close()
    saver.finalize()
    slowest = [None] * world
    torch_dist.all_gather_object(slowest, {"timings": timings, "peak_export": peak_export})
    if rank == 0:
        Path(result).write_text(json.dumps({"bytes": size, "ranks": slowest}))
    torch_dist.destroy_process_group()


def run_configuration(world: int, mib: int, rounds: int, workdir: Path) -> dict:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    result = folder / "result.json"
    mp.start_processes(_worker, args=(world, _free_port(), mib, rounds, str(folder), str(result)), nprocs=world,
                       start_method="spawn")
    data = json.loads(result.read_text())
    shutil.rmtree(folder)
    return data


def run(mib: int, rounds: int, repeats: int, workdir: Path) -> dict:
    per_world: dict[int, dict[str, list[float]]] = {w: {"dump": [], "export": [], "gather": []} for w in (1, 2)}
    peaks: list[int] = []
    size = 0
    for repeat in range(repeats):
        for world in (1, 2):
            data = run_configuration(world, mib, rounds, workdir)
            size = data["bytes"]
            for kind in ("dump", "export", "gather"):
                per_round = zip(*(rank["timings"][kind] for rank in data["ranks"]))
                per_world[world][kind] += [max(times) for times in per_round]  # the slowest rank
            if world == 2:
                peaks += [rank["peak_export"] for rank in data["ranks"]]
            print(f"  repeat {repeat + 1}/{repeats}: {world} rank(s) done", file=sys.stderr, flush=True)
    return {"bytes": size, "peaks": peaks,
            "median": {w: {k: statistics.median(v) for k, v in kinds.items()} for w, kinds in per_world.items()}}


def report(result: dict, machine: str) -> str:
    size, median = result["bytes"], result["median"]
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine}; fp32 state of {size / 2**20:.0f} MiB, model only; "
             "2 ranks: FSDP2 on gloo; times are the slowest rank's, medians.", "",
             "| operation | 1 rank (s) | 2 ranks (s) | 1 rank GB/s | 2 ranks aggregate GB/s | ratio | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, label in (("dump", "recovery dump (durable)"), ("export", "HF export (durable)")):
        one, two = median[1][kind], median[2][kind]
        ratio = one / two
        lines.append(f"| {label} | {one:.2f} | {two:.2f} | {size / one / 1e9:.2f} | {size / two / 1e9:.2f} | "
                     f"{ratio:.2f} | {'PASS' if ratio >= AGGREGATE_TARGET else 'FAIL'} (>= {AGGREGATE_TARGET}) |")
    gather = median[2]["gather"]
    lines += ["", f"The 2-rank export gathers every tensor over gloo: the gathers alone (no disk) take {gather:.2f} s "
              f"({size / gather / 1e9:.2f} GB/s), so the export cannot beat that on this machine, whatever the disk does."]
    budget = SHARD_SIZE
    peak = max(result["peaks"])
    lines += ["", "| export memory per rank (2 ranks), beyond its own resident shard | measured | "
              "budget: one max_shard_size buffer | verdict |",
              "| --- | --- | --- | --- |",
              f"| peak extra resident memory, worst rank | {peak / 2**20:.0f} MiB | {budget / 2**20:.0f} MiB | "
              f"{'PASS' if peak <= budget else 'FAIL'} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="state size in MiB (fp32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed saves per configuration run")
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the 1- and 2-rank runs")
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)
    workdir = scratch_folder("bench-multirank-")
    try:
        result = run(args.size, args.rounds, args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(result, machine_description())
    print(text)
    if args.out:
        Path(args.out).write_text(f"# Benchmarks: two ranks, one disk\n\nRerun: `make bench` (or "
                                  f"`python benchmarks/bench_multirank.py --help`).\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
