"""`make scale` (second part): what one recovery dump and load cost each rank, at 1 to 4 ranks.

A model-shaped state (see bench.py; with AdamW's moments after one step, three tensors per
parameter) is sharded by FSDP2 over 1, 2, 3 and 4 gloo processes, dumped ``--dumps`` times and
loaded back on the same number of ranks. Every collective of areal_ckpt goes through
``areal_ckpt.dist``, which counts each rank's calls and payload bytes; the table gives them for
rank 0 and for the busiest other rank, for the first dump (which makes the global plan), the
later ones (which reuse it) and the load, with times (the slowest rank, median of the later
dumps), the sizes of what only rank 0 writes (the metadata and the manifest) and of the slice
of the metadata one rank reads on a load at the same number of ranks. A
least-squares line through the 1-4 rank points extrapolates each to 1024 ranks. The measured
section of docs/scale.md is replaced; the prose around it is kept.

    python benchmarks/bench_scale.py --size 256 --dumps 3 --out docs/scale.md
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
from common import free_port, machine_description, model_of_size, scratch_folder, state_bytes

import areal_ckpt as ac
from areal_ckpt import dist
from areal_ckpt.formats.dcp_metadata import read_metadata_json
from areal_ckpt.formats.dcp_slices import INDEX_JSON, chunks_file_for, rank_metadata

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1)
WORLDS = (1, 2, 3, 4)
EXTRAPOLATE_TO = 1024
BEGIN, END = "<!-- measured by benchmarks/bench_scale.py: begin -->", "<!-- measured: end -->"


def _worker(rank: int, world: int, port: int, mib: int, dumps: int, workdir: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch_dist.init_process_group("gloo", rank=rank, world_size=world)
    measured = _measure(mib, dumps, workdir)
    gathered = [None] * world
    torch_dist.all_gather_object(gathered, measured)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    gc.collect()  # FSDP2 modules sit in reference cycles; see bench_multirank.py
    torch_dist.destroy_process_group()


def _sharded(mib: int) -> tuple[torch.nn.Module, ac.TorchEngine, int, int]:
    model = model_of_size(mib, torch.float32)
    size = state_bytes(model) * 3  # weights and AdamW's two moments
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    tensors = 3 * len(list(model.parameters()))
    return model, ac.TorchEngine(model, optimizer=optimizer), size, tensors


def _measure(mib: int, dumps: int, workdir: str) -> dict:
    model, engine, size, tensors = _sharded(mib)
    config = ac.RecoverConfig(mode="sync", experiment_name="scale", fileroot=workdir, user="bench", trial_name="t")
    handler = ac.RecoverHandler(config, SPEC)
    phases: dict[str, list[dict]] = {"first dump": [], "later dumps": [], "load": []}
    for index in range(dumps):
        torch_dist.barrier()
        before, start = dist.traffic(), time.perf_counter()
        handler.dump(engine, ac.StepInfo(0, index, index, 10**6), force=True)
        seconds = time.perf_counter() - start
        phases["first dump" if index == 0 else "later dumps"].append({**vars(dist.traffic() - before), "s": seconds})
    handler.close()
    del model, engine
    gc.collect()
    _, fresh, _, _ = _sharded(mib)
    torch_dist.barrier()
    before, start = dist.traffic(), time.perf_counter()
    ac.RecoverHandler(config, SPEC).load(fresh)
    phases["load"].append({**vars(dist.traffic() - before), "s": time.perf_counter() - start})
    current = Path(workdir) / "checkpoints/bench/scale/t/.recover/current"
    sizes = {
        name: (current / name).stat().st_size
        for name in (
            "default/dcp_metadata.json",
            "default/.metadata",
            "recover_info/areal_ckpt_manifest.json",
            f"default/{INDEX_JSON}",
        )
    }
    chunks = current / "default" / chunks_file_for(f"__{dist.rank()}_0.distcp")
    whole, sliced = [], []
    for _ in range(3):  # what a rank parses first on a load: its slice (same ranks), the whole metadata (others)
        start = time.perf_counter()
        read_metadata_json(current / "default")
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        rank_metadata(current / "default", dist.rank())
        sliced.append(time.perf_counter() - start)
    return {
        "bytes": size,
        "tensors": tensors,
        "phases": phases,
        "rank0_files": sizes,
        "chunk_file": chunks.stat().st_size if chunks.is_file() else 0,
        "metadata_parse_s": statistics.median(whole),
        "slice_parse_s": statistics.median(sliced),
    }


def run_world(world: int, mib: int, dumps: int, workdir: Path) -> list[dict]:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    result = folder / "result.json"
    mp.start_processes(
        _worker, args=(world, free_port(), mib, dumps, str(folder), str(result)), nprocs=world, start_method="spawn"
    )
    ranks = json.loads(result.read_text())
    shutil.rmtree(folder)
    return ranks


def _per_phase(ranks: list[dict], phase: str) -> dict:
    """Rank 0's and the busiest other rank's traffic (median over the phase's repeats), and the
    slowest rank's median time."""

    def moved(rank: dict) -> dict:
        entries = rank["phases"][phase]
        return {key: statistics.median(entry[key] for entry in entries) for key in ("calls", "sent", "received", "s")}

    each = [moved(rank) for rank in ranks]
    others = each[1:] or [None]
    busiest = max(others, key=lambda e: -1 if e is None else e["sent"] + e["received"])
    return {"rank0": each[0], "other": busiest, "seconds": max(e["s"] for e in each)}


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def _kib(value: float) -> str:
    return f"{value / 1024:.1f}"


def render(results: dict[int, list[dict]], dumps: int) -> str:
    first = results[WORLDS[0]][0]
    lines = [
        BEGIN,
        "",
        f"Measured on {machine_description()}: a {first['bytes'] / 2**20:.0f} MiB model + AdamW state "
        f"({first['tensors']} tensors), FSDP2 over gloo, {dumps} dumps per run (the first makes the plan), "
        "then one load on the same number of ranks. Bytes are collective payload per rank per operation "
        '(KiB, sent + received); "other" is the busiest non-zero rank.',
        "",
        "| ranks | phase | calls | rank 0 KiB | other rank KiB | slowest rank s |",
        "|---|---|---|---|---|---|",
    ]
    for world, ranks in results.items():
        for phase in ("first dump", "later dumps", "load"):
            row = _per_phase(ranks, phase)
            other = row["other"]
            other_kib = "-" if other is None else _kib(other["sent"] + other["received"])
            lines.append(
                f"| {world} | {phase} | {row['rank0']['calls']:.0f} | "
                f"{_kib(row['rank0']['sent'] + row['rank0']['received'])} | {other_kib} | {row['seconds']:.2f} |"
            )
    lines += [
        "",
        "Files only rank 0 writes (bytes), per model and per dump; the largest rank's chunk file; "
        "and the time one rank takes to parse the metadata a load starts with: its slice (index and own "
        "chunk file, a load on the same number of ranks) or the whole `dcp_metadata.json` (any other load):",
        "",
        "| ranks | dcp_metadata.json | .metadata | manifest | dcp_index.json | chunk file | "
        "slice parse s | whole parse s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in results.items():
        files = ranks[0]["rank0_files"]
        lines.append(
            f"| {world} | {files['default/dcp_metadata.json']} | {files['default/.metadata']} | "
            f"{files['recover_info/areal_ckpt_manifest.json']} | {files[f'default/{INDEX_JSON}']} | "
            f"{max(rank['chunk_file'] for rank in ranks)} | {max(rank['slice_parse_s'] for rank in ranks):.3f} | "
            f"{ranks[0]['metadata_parse_s']:.3f} |"
        )
    worlds = list(results)
    lines += [
        "",
        f"Least-squares lines through these points, extrapolated to {EXTRAPOLATE_TO} ranks:",
        "",
        "| quantity | per added rank | at 1024 ranks |",
        "|---|---|---|",
    ]
    series = {
        "rank 0 KiB per later dump": [_sum_kib(_per_phase(results[w], "later dumps")["rank0"]) for w in worlds],
        "other rank KiB per later dump": [_sum_kib(_per_phase(results[w], "later dumps")["other"]) for w in worlds[1:]],
        "dcp_metadata.json KiB": [results[w][0]["rank0_files"]["default/dcp_metadata.json"] / 1024 for w in worlds],
        ".metadata KiB": [results[w][0]["rank0_files"]["default/.metadata"] / 1024 for w in worlds],
        "manifest KiB": [results[w][0]["rank0_files"]["recover_info/areal_ckpt_manifest.json"] / 1024 for w in worlds],
        "slice a rank reads on a same-size load KiB": [
            (results[w][0]["rank0_files"][f"default/{INDEX_JSON}"] + max(r["chunk_file"] for r in results[w])) / 1024
            for w in worlds[1:]  # on one rank every tensor is stored whole: all of it is in the index
        ],
    }
    parse = [results[w][0]["metadata_parse_s"] for w in worlds]
    for name, ys in series.items():
        xs = worlds[1:] if name.startswith(("other", "slice")) else worlds
        intercept, slope = _fit(xs, ys)
        at_scale = (
            f"{intercept + slope * EXTRAPOLATE_TO:.0f} KiB"
            if slope > 0.05 * max(ys) / max(xs)
            else f"at most {max(ys):.1f} KiB (does not grow)"
        )
        lines.append(f"| {name} | {slope:+.2f} KiB | {at_scale} |")
    sizes = series["dcp_metadata.json KiB"]
    rate = statistics.median(seconds / kib for seconds, kib in zip(parse, sizes))  # parse time grows with bytes
    intercept, slope = _fit(worlds, sizes)
    lines.append(
        f"| whole metadata parse per rank on another-size load ({rate * 1e6:.0f} us per KiB, the median rate) | "
        f"{slope * rate * 1000:+.1f} ms | {(intercept + slope * EXTRAPOLATE_TO) * rate:.1f} s |"
    )
    lines += ["", END]
    return "\n".join(lines)


def _sum_kib(entry: dict | None) -> float:
    return 0.0 if entry is None else (entry["sent"] + entry["received"]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=int, default=256, help="MiB of fp32 weights (hidden 1024: 4 layers, 153 tensors)"
    )
    parser.add_argument("--dumps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    workdir = scratch_folder("scale")
    try:
        results = {}
        for world in WORLDS:
            results[world] = run_world(world, args.size, args.dumps, workdir)
            print(f"{world} ranks measured", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = render(results, args.dumps)
    text = args.out.read_text() if args.out.exists() else f"# Scale\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{args.out}: the measured section's markers are missing")
    head, rest = text.split(BEGIN, 1)
    args.out.write_text(head + table + rest.split(END, 1)[1])
    print(table)


if __name__ == "__main__":
    main()
