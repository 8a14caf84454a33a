"""`make bench` (third part): two ranks on one disk against one rank, and export memory per rank.

The same model-shaped state (see bench.py) is dumped (RecoverHandler, model only) and exported
(Saver) by one process, and by two gloo processes with the model sharded by FSDP2 or
replicated by DDP. Aggregate throughput is the state's bytes over the slowest rank's time.
Disk speed drifts, so every repeat runs each configuration once (the order rotating between
repeats) and a 2-rank configuration is compared with the single rank of its own repeat.
During the 2-rank export each rank's peak extra resident memory (beyond its own shard,
already resident) is compared with one ``max_shard_size`` buffer, the issue's budget (the
export holds at most two gathered tensors: the one it writes and the next, in flight). The
2-rank run also times the export's gathers alone (its rounds of files, each tensor made whole
on the rank that writes it, nothing written): the floor the network (here gloo over loopback)
puts under an FSDP2 export.

    python benchmarks/bench_multirank.py --size 1024 --rounds 3 --out docs/benchmarks-multirank.md
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from common import PeakRss, free_port, machine_description, model_of_size, scratch_folder, state_bytes
from torch.distributed.tensor import DTensor

import areal_ckpt as ac
from areal_ckpt.formats.hf_export import plan_export

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1)
SHARD_SIZE = 256 * 2**20
AGGREGATE_TARGET = 0.9


def _step(step: int) -> ac.StepInfo:
    return ac.StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6)


CONFIGURATIONS = [(1, "plain"), (2, "fsdp2"), (2, "ddp")]  # (ranks, wrapping)


def _worker(rank: int, world: int, wrap: str, port: int, mib: int, rounds: int, workdir: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    # the model (a DDP reducer holds the group) is gone when _measure returns: a DDP model
    # freed after destroy_process_group can deadlock torch's gloo teardown on the GIL
    size, timings, peak_export = _measure(wrap, mib, rounds, workdir, world)
    slowest = [None] * world
    torch_dist.all_gather_object(slowest, {"timings": timings, "peak_export": peak_export})
    if rank == 0:
        Path(result).write_text(json.dumps({"bytes": size, "ranks": slowest}))
    # FSDP2 modules and DTensors sit in reference cycles; left to interpreter shutdown, the
    # objects of the timed DTensor.full_tensor() calls made torch 2.13's gloo threads abort
    # the process (SIGABRT) in about one exit in five here
    gc.collect()
    torch_dist.destroy_process_group()


def _measure(wrap: str, mib: int, rounds: int, workdir: str, world: int) -> tuple[int, dict[str, list[float]], int]:
    """(state bytes, this rank's timings per operation, peak extra RSS during exports)."""
    model = model_of_size(mib, torch.float32)
    size = state_bytes(model)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    engine = ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    names = dict(experiment_name="bench", fileroot=workdir, user="bench", trial_name=f"w{world}")
    handler = ac.RecoverHandler(ac.RecoverConfig(mode="sync", **names), SPEC)
    saver = ac.Saver(ac.SaverConfig(mode="sync", keep_last=1, max_shard_size=SHARD_SIZE, **names), SPEC)
    timings: dict[str, list[float]] = {"dump": [], "export": [], "gather": [], "all-gather": []}
    files = list(plan_export(engine.export_specs(), SHARD_SIZE, None).files.values())
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
        for first in range(0, len(files), world):  # the export's rounds of gathers, without the disk
            for _ in engine.gather_round(files[first : first + world]):
                pass
        timings["gather"].append(time.perf_counter() - start)
        torch_dist.barrier()
        start = time.perf_counter()
        for tensor in model.state_dict().values():  # the same, each tensor made whole on every rank
            if isinstance(tensor, DTensor):
                tensor.full_tensor()
        timings["all-gather"].append(time.perf_counter() - start)
    handler.close()
    saver.finalize()
    return size, timings, peak_export


def run_configuration(world: int, wrap: str, mib: int, rounds: int, workdir: Path) -> dict:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    result = folder / "result.json"
    mp.start_processes(
        _worker,
        args=(world, wrap, free_port(), mib, rounds, str(folder), str(result)),
        nprocs=world,
        start_method="spawn",
    )
    data = json.loads(result.read_text())
    shutil.rmtree(folder)
    return data


def run(mib: int, rounds: int, repeats: int, workdir: Path) -> dict:
    """Every configuration once per repeat, the order rotating between repeats; per repeat, each
    2-rank configuration's ratio to the single rank of that same repeat (so a drifting disk
    cancels out), and over all repeats the medians of seconds and of those ratios."""
    seconds = {wrap: {"dump": [], "export": [], "gather": [], "all-gather": []} for _, wrap in CONFIGURATIONS}
    ratios: dict[str, dict[str, list[float]]] = {wrap: {"dump": [], "export": []} for _, wrap in CONFIGURATIONS[1:]}
    peaks: list[int] = []
    size = 0
    for repeat in range(repeats):
        shift = repeat % len(CONFIGURATIONS)
        this_repeat: dict[str, dict[str, float]] = {}
        for world, wrap in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
            data = run_configuration(world, wrap, mib, rounds, workdir)
            size = data["bytes"]
            this_repeat[wrap] = {}
            for kind in ("dump", "export", "gather", "all-gather"):
                per_round = [max(times) for times in zip(*(rank["timings"][kind] for rank in data["ranks"]))]
                seconds[wrap][kind] += per_round  # the slowest rank of each round
                this_repeat[wrap][kind] = statistics.median(per_round)
            if wrap == "fsdp2":
                peaks += [rank["peak_export"] for rank in data["ranks"]]
            print(f"  repeat {repeat + 1}/{repeats}: {world} rank(s), {wrap} done", file=sys.stderr, flush=True)
        for wrap, kinds in ratios.items():
            for kind, values in kinds.items():
                values.append(this_repeat["plain"][kind] / this_repeat[wrap][kind])
    return {
        "bytes": size,
        "peaks": peaks,
        "ratios": ratios,
        "median": {wrap: {k: statistics.median(v) for k, v in kinds.items()} for wrap, kinds in seconds.items()},
    }


def report(result: dict, machine: str) -> str:
    size, median = result["bytes"], result["median"]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}; fp32 state of {size / 2**20:.0f} MiB, model only; "
        "2 ranks on gloo, the model sharded by FSDP2 or replicated by DDP; times are the slowest rank's, "
        f"medians over {len(result['ratios']['fsdp2']['dump'])} repeats. The ratio is the median over repeats "
        "of the single rank's time over the two ranks' time in the same repeat; its range shows how much "
        "that moved between repeats.",
        "",
        "| operation | 1 rank (s) | 2 ranks (s) | 1 rank GB/s | 2 ranks aggregate GB/s | ratio (paired) | "
        "range over repeats | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, label in (("dump", "recovery dump (durable)"), ("export", "HF export (durable)")):
        for wrap in ("fsdp2", "ddp"):
            one, two = median["plain"][kind], median[wrap][kind]
            paired = result["ratios"][wrap][kind]
            ratio = statistics.median(paired)
            lines.append(
                f"| {label}, {wrap.upper()} | {one:.2f} | {two:.2f} | {size / one / 1e9:.2f} | "
                f"{size / two / 1e9:.2f} | {ratio:.2f} | {min(paired):.2f}-{max(paired):.2f} | "
                f"{'PASS' if ratio >= AGGREGATE_TARGET else 'FAIL'} (>= {AGGREGATE_TARGET}) |"
            )
    gather, all_gather = median["fsdp2"]["gather"], median["fsdp2"]["all-gather"]
    lines += [
        "",
        f"An FSDP2 export gathers every tensor over gloo, each to the rank that writes it (both ranks "
        f"send and receive at once): those gathers alone (no disk) take {gather:.2f} s "
        f"({size / gather / 1e9:.2f} GB/s), a floor under the FSDP2 export on this machine whatever the "
        "disk does. Making every tensor whole on every rank instead "
        f"(`DTensor.full_tensor()`) takes {all_gather:.2f} s. DDP exports write straight from each rank's "
        "replica, without gathers.",
    ]
    budget = SHARD_SIZE
    peak = max(result["peaks"])
    lines += [
        "",
        "| export memory per rank (2 ranks), beyond its own resident shard | measured | "
        "budget: one max_shard_size buffer | verdict |",
        "| --- | --- | --- | --- |",
        f"| peak extra resident memory, worst rank | {peak / 2**20:.0f} MiB | {budget / 2**20:.0f} MiB | "
        f"{'PASS' if peak <= budget else 'FAIL'} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="state size in MiB (fp32)")
    parser.add_argument("--rounds", type=int, default=3, help="timed saves per configuration run")
    parser.add_argument("--repeats", type=int, default=4, help="alternations of the configurations")
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
        Path(args.out).write_text(
            f"# Benchmarks: two ranks, one disk\n\nRerun: `make bench` (or "
            f"`python benchmarks/bench_multirank.py --help`).\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
