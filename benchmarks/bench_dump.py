"""`make bench` (seventh part): recovery dumps as a training job makes them, against a raw write.

One process trains a Qwen2-shaped model one step with AdamW (so the state is the weights and
two moments), then one RecoverHandler (defaults, ``mode: on``) dumps it ``--rounds`` times into
one trial, as a job does: every dump after the first reuses the save plan and deletes the
generation it supersedes, off the dump's path; the benchmark waits for that deletion after each
dump (untimed, as a job's training steps would pass meanwhile) and reports how long it ran on,
and pauses ``--pause`` seconds (default 3) after every write and its deletion, the raw ones too. Each dump is paired with a raw write + fsync of the same bytes (one
new file, the tensors back to back; the previous one is deleted before the clock starts), the
order alternating per round; the ratio is raw seconds over dump seconds per pair, reported as
the median and the range over the pairs.

    python benchmarks/bench_dump.py --size 135 --rounds 5 --out docs/benchmarks-dump.md
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from common import machine_description, model_of_size, publish, scratch_folder, size_and_rounds, state_tensors

import areal_ckpt as ac
from areal_ckpt.generations.store import wait_for_deletions

TOKENS = torch.arange(32).reshape(2, 16)


def write_raw(tensors: list[torch.Tensor], path: Path) -> None:
    """The tensors' bytes back to back into one new file, fsync'd (file and folder)."""
    with open(path, "wb", buffering=0) as handle:
        for tensor in tensors:
            handle.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(handle.fileno())
    folder = os.open(path.parent, os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)


def measure(mib: int, rounds: int, pause: float) -> tuple[int, list[dict[str, float]]]:
    """(state bytes, one row per round: raw and dump seconds)."""
    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    engine = ac.TorchEngine(model, optimizer)
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=2)
    tensors = state_tensors(model, optimizer)
    size = sum(t.numel() * t.element_size() for t in tensors)
    work = scratch_folder("bench-dump-")
    config = ac.RecoverConfig(experiment_name="bench", trial_name="t", fileroot=str(work), user="bench", mode="on")
    handler = ac.RecoverHandler(config, spec)
    raw_folder = work / "raw"
    raw_folder.mkdir()
    rows = []
    try:
        for index in range(rounds + 1):  # the first dump makes the plan and has nothing to delete: not counted
            row: dict[str, float] = {}
            for what in ("raw", "dump") if index % 2 == 0 else ("dump", "raw"):
                if what == "raw":
                    start = time.perf_counter()
                    write_raw(tensors, raw_folder / "raw.bin")
                    row[what] = time.perf_counter() - start
                    (raw_folder / "raw.bin").unlink()  # untimed, as the dump's deletion is
                    time.sleep(pause)
                    continue
                step = ac.StepInfo(epoch=0, epoch_step=index, global_step=index, steps_per_epoch=500)
                start = time.perf_counter()
                handler.dump(engine, step, force=True)
                row[what] = time.perf_counter() - start
                start = time.perf_counter()  # the superseded generation's deletion, after the dump returned
                wait_for_deletions()
                row["deletion"] = time.perf_counter() - start
                time.sleep(pause)
            if index:
                rows.append({**row, "raw first": float(index % 2 == 0)})
        handler.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return size, rows


def render(size: int, rows: list[dict[str, float]], pause: float) -> str:
    ratios = [row["raw"] / row["dump"] for row in rows]
    dumps = [row["dump"] for row in rows]
    raws = [row["raw"] for row in rows]
    deletions = [row["deletion"] for row in rows]
    return "\n".join(
        [
            "# Recovery dumps as a job makes them",
            "",
            f"{time.strftime('%Y-%m-%d')}: {machine_description()}; one process, fp32, a Qwen2-shaped model and "
            f"its AdamW state, {size / 2**20:.0f} MiB in all; {len(rows)} dumps by one RecoverHandler into one "
            "trial (after a first, not counted), each paired with a raw write + fsync of the same bytes, the "
            f"order alternating; each write's predecessor is deleted right after it (untimed), then {pause:g} s "
            "pass (a job's training steps; on this VM memory freed just before a write makes that write slow, "
            "whichever it is). Regenerate: "
            "`python benchmarks/bench_dump.py --out docs/benchmarks-dump.md`.",
            "",
            "| | median s | range s | GB/s |",
            "| --- | --- | --- | --- |",
            f"| raw write + fsync | {statistics.median(raws):.2f} | {min(raws):.2f}-{max(raws):.2f} | "
            f"{size / statistics.median(raws) / 1e9:.2f} |",
            f"| RecoverHandler.dump | {statistics.median(dumps):.2f} | {min(dumps):.2f}-{max(dumps):.2f} | "
            f"{size / statistics.median(dumps) / 1e9:.2f} |",
            f"| its deletion of the superseded dump, after it returned | {statistics.median(deletions):.2f} | "
            f"{min(deletions):.2f}-{max(deletions):.2f} | |",
            "",
            f"Dump against the raw write (raw seconds / dump seconds, per pair): median "
            f"{statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x (goal >= 0.9x). "
            f"Pairs whose raw write came first: {_median_of(rows, ratios, True)}; whose dump came first: "
            f"{_median_of(rows, ratios, False)}.",
            "",
        ]
    )


def _median_of(rows: list[dict[str, float]], ratios: list[float], raw_first: bool) -> str:
    chosen = [ratio for row, ratio in zip(rows, ratios) if bool(row["raw first"]) == raw_first]
    return f"median {statistics.median(chosen):.2f}x of {len(chosen)}" if chosen else "none"


def main() -> int:
    parser = size_and_rounds(__doc__, 135, "MiB of fp32 weights (the state is about three times that)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between two writes (a job's steps)")
    args = parser.parse_args()
    size, rows = measure(args.size, args.rounds, args.pause)
    return publish(render(size, rows, args.pause), args.out)


if __name__ == "__main__":
    sys.exit(main())
