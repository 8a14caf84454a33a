"""`make bench` (seventh part): tiered recovery dumps (`recover.local_dir` over object storage,
then over a shared POSIX folder) against a dump to a local trial, and their background upload
against the S3 client's raw upload (or a plain copy into the folder).

A real S3 server (SeaweedFS, `weed mini` on 127.0.0.1, its data on this machine's disk) and one
process. Each round, interleaved and alternating the order: a tiered dump of a Qwen2-shaped fp32
model with AdamW state (the seconds `dump` blocked, then `wait()` for its upload) against a sync
dump of the same state to a local `fileroot` (blocking seconds); the upload's own seconds (the
background job: owner check, every file up, manifest, commit record) against boto3's
`upload_file` of the same number of bytes (64 MiB parts, 8 at once on both sides); a resume of
the tiered dump on its own node (from the local tier) against a resume of the local dump.
Controls pair a local dump with a local dump, and a raw upload with a raw upload.

    python benchmarks/bench_tiered.py --size 400 --rounds 5 --out docs/benchmarks-tiered.md
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_objects import _raw_put, server_and_state
from common import machine_description, publish, size_and_rounds

import areal_ckpt as ac

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=2)
TOKENS = torch.arange(32).reshape(2, 16)
STEP = ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=500)
PAUSE_SECONDS = 3.0  # between measurements, as a job's steps are: a write right after a large free is slow here


def _in_order(first: bool, one: Callable[[], None], other: Callable[[], None]) -> None:
    for run in (one, other) if first else (other, one):
        run()
        time.sleep(PAUSE_SECONDS)


def _raw_copy(size: int, work: Path) -> float:
    """Seconds to copy ``size`` bytes (from the page cache) into a new file of the shared folder
    and fsync it and the folder: what the upload to a shared POSIX fileroot does at its best."""
    source = work / "raw.bin"
    if not source.exists() or source.stat().st_size != size:
        with open(source, "wb") as handle:
            for start in range(0, size, 64 << 20):
                handle.write(os.urandom(min(64 << 20, size - start)))
    target = work / "shared-raw" / "raw.bin"
    shutil.rmtree(target.parent, ignore_errors=True)
    start = time.perf_counter()
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target)
    descriptor = os.open(target, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)
    folder = os.open(target.parent, os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)
    return time.perf_counter() - start


def measure(mib: int, rounds: int, behind: str = "s3") -> list[dict[str, float]]:
    """One row per round: seconds of the tiered dump, the local dump, the upload, the raw upload;
    the trial persisting on the S3 server (``behind`` "s3") or in a folder standing for a shared
    file system ("posix", raw upload: a copy into it)."""
    work, server, client, model, optimizer = server_and_state("bench-tiered-", mib)
    engine = ac.TorchEngine(model, optimizer)
    rows = []
    try:
        for index in range(rounds):
            row: dict[str, float] = {}
            fields = dict(experiment_name="bench", user="bench", mode="sync")

            fileroot = "s3://bench/runs" if behind == "s3" else str(work / "shared")
            tiered_config = ac.RecoverConfig(
                **fields, trial_name=f"t{index}", fileroot=fileroot, local_dir=str(work / "tier")
            )
            local_config = ac.RecoverConfig(**fields, trial_name=f"local{index}", fileroot=str(work / "local"))

            def tiered() -> None:
                handler = ac.RecoverHandler(tiered_config, SPEC)
                handler.dump(engine, STEP, force=True)
                row["tiered"] = handler.last_metrics["time/saving"]
                handler.wait()
                row["upload"], row["upload bytes"] = (
                    handler.last_metrics["upload/seconds"],
                    handler.last_metrics["upload/bytes"],
                )
                handler.close()

            def local(name: str) -> Callable[[], None]:
                def run() -> None:
                    trial = f"{name.replace(' ', '-')}{index}"
                    config = ac.RecoverConfig(**fields, trial_name=trial, fileroot=str(work / "local"))
                    handler = ac.RecoverHandler(config, SPEC)
                    handler.dump(engine, STEP, force=True)
                    row[name] = handler.last_metrics["time/saving"]
                    handler.close()
                    if name != "local":  # a control's dump is not loaded: deleted at once
                        shutil.rmtree(work / "local/checkpoints/bench/bench" / trial)

                return run

            def load(name: str, config: ac.RecoverConfig) -> Callable[[], None]:
                def run() -> None:
                    handler = ac.RecoverHandler(config, SPEC)
                    start = time.perf_counter()
                    handler.load(engine)
                    row[name] = time.perf_counter() - start
                    handler.close()

                return run

            _in_order(index % 2 == 0, tiered, local("local"))
            _in_order(index % 2 == 0, load("tiered load", tiered_config), load("local load", local_config))
            for folder in ("tier", "local", "shared"):  # each dump's bytes are freed before the next writes
                shutil.rmtree(work / folder, ignore_errors=True)
            time.sleep(PAUSE_SECONDS)
            _in_order(index % 2 == 0, local("control"), local("local control"))
            size = int(row["upload bytes"])
            raw = (lambda: _raw_put(client, size, work)) if behind == "s3" else (lambda: _raw_copy(size, work))
            row["raw upload"], row["control upload"], row["raw control upload"] = raw(), raw(), raw()
            rows.append(row)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _ratio(rows: list[dict[str, float]], numerator: str, denominator: str) -> str:
    ratios = [row[numerator] / row[denominator] for row in rows]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(rows: list[dict[str, float]], mib: int, rounds: int) -> str:
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    size = f"{median['upload bytes'] / 2**20:.0f} MiB"
    lines = [
        "# Tiered recovery dumps: local tier first, object storage in the background",
        "",
        f"Measured by `benchmarks/bench_tiered.py --size {mib} --rounds {rounds}` on {machine_description()}, "
        f"{time.strftime('%Y-%m-%d')}: one process, fp32 Qwen2-shaped model of {mib} MiB with AdamW state, "
        "SeaweedFS (`weed mini`) on 127.0.0.1 sharing the machine's two cores and disk. Blocking: the seconds "
        "`RecoverHandler.dump` held the loop, tiered (`recover.local_dir` under an `s3://` fileroot; the "
        "upload then runs in a background process and is waited for before the next measurement) against a "
        "sync dump to a local `fileroot`, right before or after it (the order alternating by round). Upload: "
        "the background job's seconds (owner check, every file, manifest, commit record) against boto3 "
        "`upload_file` of the same number of bytes from the page cache, same transfer settings. Load: "
        "`RecoverHandler.load` on the tiered trial's own node (it reads the local tier, after one listing of the "
        "bucket's commit log) against a load of the local dump, alternating. Per round "
        "ratios, median (range); the control rows pair a measurement with itself, so their range is how far "
        "a ratio moves here with nothing changed. Each dump's files are deleted before the next pair writes, "
        "and each measurement is followed by a 3 s pause (as a job's steps are), as in `bench_dump.py`.",
        "",
        "| measured | bytes | ours (s) | against (s) | ratio | goal |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| tiered dump blocking / local dump blocking | {size} | {median['tiered']:.2f} | {median['local']:.2f} | "
        f"{_ratio(rows, 'tiered', 'local')} | <= 1.1x |",
        f"| control: local dump / local dump | {size} | {median['control']:.2f} | {median['local control']:.2f} | "
        f"{_ratio(rows, 'control', 'local control')} | |",
        f"| tiered load (own node) / local load | {size} | {median['tiered load']:.2f} | "
        f"{median['local load']:.2f} | {_ratio(rows, 'tiered load', 'local load')} | <= 1.1x |",
        f"| raw upload / background upload | {size} | {median['upload']:.2f} | {median['raw upload']:.2f} | "
        f"{_ratio(rows, 'raw upload', 'upload')} | >= 0.9x |",
        f"| control: raw upload / raw upload | {size} | {median['control upload']:.2f} | "
        f"{median['raw control upload']:.2f} | {_ratio(rows, 'raw control upload', 'control upload')} | |",
    ]
    return "\n".join(lines) + "\n"


def report_posix(rows: list[dict[str, float]], mib: int, rounds: int) -> str:
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    size = f"{median['upload bytes'] / 2**20:.0f} MiB"
    return (
        "\n".join(
            [
                "## Over a shared POSIX folder",
                "",
                f"The same {rounds} rounds with the trial persisting in a folder of this disk standing for a shared "
                "file system (Lustre, NFS, GPFS: `fileroot` a path, `local_dir` in front of it). Its upload copies "
                "each file in, checks it, fsyncs and switches `current`; the raw baseline copies the same number "
                "of bytes into one new file there and fsyncs it and its folder.",
                "",
                "| measured | bytes | ours (s) | against (s) | ratio | goal |",
                "| --- | --- | --- | --- | --- | --- |",
                f"| tiered dump blocking / local dump blocking | {size} | {median['tiered']:.2f} | "
                f"{median['local']:.2f} | {_ratio(rows, 'tiered', 'local')} | <= 1.1x |",
                f"| control: local dump / local dump | {size} | {median['control']:.2f} | "
                f"{median['local control']:.2f} | {_ratio(rows, 'control', 'local control')} | |",
                f"| tiered load (own node) / local load | {size} | {median['tiered load']:.2f} | "
                f"{median['local load']:.2f} | {_ratio(rows, 'tiered load', 'local load')} | <= 1.1x |",
                f"| raw copy + fsync / background upload | {size} | {median['upload']:.2f} | "
                f"{median['raw upload']:.2f} | {_ratio(rows, 'raw upload', 'upload')} | >= 0.9x |",
                f"| control: raw copy / raw copy | {size} | {median['control upload']:.2f} | "
                f"{median['raw control upload']:.2f} | {_ratio(rows, 'raw control upload', 'control upload')} | |",
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = size_and_rounds(__doc__, 400, "MiB of fp32 weights").parse_args(argv)
    text = report(measure(args.size, args.rounds), args.size, args.rounds)
    text += "\n" + report_posix(measure(args.size, args.rounds, "posix"), args.size, args.rounds)
    return publish(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
