"""`make bench` (`areal-ckpt diff`): comparing two recovery checkpoints against reading their bytes.

Two recovery dumps of one state (a Qwen2-shaped model and its AdamW state, fp32) are written in
two trials: equal tensors, other files. Each round reads every file of both once (the raw read,
8 MiB at a time, nothing done with the bytes), runs `diff_checkpoints` on them (what `areal-ckpt
diff A B` runs once its process started: every file checked against its manifest, then every
tensor read and compared bitwise) and reads them raw again (the control), the order alternating.
Measured twice: from the disk (every file dropped from the page cache before each of the three,
as a user meets two checkpoints written a while ago: the goal's row) and from the page cache.
The ratio is raw read time over diff time (goal >= 0.8x: the comparison costs at most a quarter
on top of reading).

    cd benchmarks && python bench_diff.py --out ../docs/benchmarks-diff.md
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from common import evict, machine_description, model_of_size, publish, scratch_folder, size_and_rounds

import areal_ckpt as ac
from areal_ckpt.tools.diff import diff_checkpoints

CHUNK = 8 << 20


def dump(work: Path, trial: str, engine: ac.TorchEngine, spec: ac.FinetuneSpec) -> Path:
    """One synchronous recovery dump of ``engine`` into the trial ``trial``; returns the trial."""
    config = ac.RecoverConfig(experiment_name="bench", trial_name=trial, fileroot=str(work), user="bench", mode="sync")
    handler = ac.RecoverHandler(config, spec)
    handler.dump(engine, ac.StepInfo(0, 1, 1, spec.steps_per_epoch), force=True)
    handler.close()
    return work / "checkpoints" / "bench" / "bench" / trial


def read_raw(folders: list[Path]) -> tuple[float, int]:
    """Seconds to read every regular file under ``folders`` once (links not followed), and bytes."""
    start, total = time.perf_counter(), 0
    buffer = bytearray(CHUNK)
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                with open(path, "rb", buffering=0) as handle:
                    while count := handle.readinto(buffer):
                        total += count
    return time.perf_counter() - start, total


def measure(mib: int, rounds: int) -> tuple[int, dict[str, list[dict[str, float]]]]:
    """Bytes of both checkpoints, and per cache state ("disk", "cache") and round the seconds of
    the raw read, the diff and the control."""
    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.arange(16).reshape(2, 8)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    engine = ac.TorchEngine(model, optimizer)
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
    work = scratch_folder("bench-diff-")
    rows: dict[str, list[dict[str, float]]] = {"disk": [], "cache": []}
    try:
        a, b = dump(work, "a", engine, spec), dump(work, "b", engine, spec)
        del model, optimizer, engine
        folders = [(trial / ".recover" / "current").resolve() for trial in (a, b)]
        size = read_raw(folders)[1]
        for state in ("disk", "cache"):
            for index in range(rounds + 1):  # the first round of each is not counted
                row: dict[str, float] = {}
                for what in ("raw", "diff", "control") if index % 2 == 0 else ("diff", "raw", "control"):
                    if state == "disk":
                        for folder in folders:
                            evict(folder)
                    row[what] = timed_diff(a, b) if what == "diff" else read_raw(folders)[0]
                if index:
                    rows[state].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return size, rows


def timed_diff(a: Path, b: Path) -> float:
    """Seconds of :func:`diff_checkpoints` of ``a`` and ``b``, which must be equal."""
    start = time.perf_counter()
    result = diff_checkpoints(a, b)
    seconds = time.perf_counter() - start
    if not result.equal:
        raise SystemExit("the two dumps of one state differ: the benchmark is wrong")
    return seconds


def render(size: int, rows: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        "# `areal-ckpt diff` against reading the bytes",
        "",
        f"{time.strftime('%Y-%m-%d')}: {machine_description()}; two recovery checkpoints of one state (a "
        f"Qwen2-shaped model and its AdamW state, fp32), {size / 2**30:.2f} GiB together; "
        f"{len(rows['disk'])} rounds from the disk (every file dropped from the page cache before each run) and "
        f"{len(rows['cache'])} from the page cache, each a raw read of every file, a `diff_checkpoints` of the two "
        "and a control raw read (the first two alternating). Regenerate: "
        "`cd benchmarks && python bench_diff.py --out ../docs/benchmarks-diff.md`.",
        "",
        "| read from | raw read of both (median s) | diff (median s) | raw / diff | range | control (raw / raw) | goal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for state, goal in (("disk", ">= 0.8x"), ("cache", "")):
        ratios = [row["raw"] / row["diff"] for row in rows[state]]
        control = [row["raw"] / row["control"] for row in rows[state]]
        lines.append(
            f"| {'the disk' if state == 'disk' else 'the page cache'} "
            f"| {statistics.median(row['raw'] for row in rows[state]):.2f} "
            f"| {statistics.median(row['diff'] for row in rows[state]):.2f} "
            f"| {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x "
            f"| {statistics.median(control):.2f}x ({min(control):.2f}-{max(control):.2f}) | {goal} |"
        )
    return "\n".join([*lines, ""])


def main() -> int:
    parser = size_and_rounds(__doc__, 340, "MiB of fp32 weights per checkpoint (each is about three times that)")
    args = parser.parse_args()
    size, rows = measure(args.size, args.rounds)
    return publish(render(size, rows), args.out)


if __name__ == "__main__":
    sys.exit(main())
