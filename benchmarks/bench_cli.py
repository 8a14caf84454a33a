"""`make bench` (command line): how long each `areal-ckpt` command takes from a shell, start to end.

A trial like the demo's (a small Qwen2 actor: two HF exports and a recovery dump with its AdamW
state) is written into a scratch folder; then each command runs as a new process, the way a
user types it, rounds interleaved, and the median wall time is reported against its goal:
`--help`, and `list`, `inspect` and `verify` of a local trial, under 1 s (none imports torch).
Most of that time is imports: each command loads only what it needs.

    python benchmarks/bench_cli.py --rounds 5 --out docs/benchmarks-cli.md
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import machine_description, model_of_size, publish, scratch_folder, size_and_rounds

import areal_ckpt as ac

#: command (after `areal-ckpt`), goal in seconds
COMMANDS = {"--help": 1.0, "list": 1.0, "inspect": 1.0, "verify": 1.0}


def make_trial(root: Path, mib: int) -> Path:
    """A trial with two exports of an actor and a recovery dump of it with its optimizer state."""
    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.arange(16).reshape(2, 8)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)
    names = {"experiment_name": "bench", "trial_name": "cli", "fileroot": str(root), "user": "bench"}
    engine = ac.TorchEngine(model, optimizer)
    saver = ac.Saver(ac.SaverConfig(**names, mode="sync"), spec)
    for step in range(2):
        saver.save(engine, 0, step, step, name="actor", force=True)
    saver.finalize()
    handler = ac.RecoverHandler(ac.RecoverConfig(**names, mode="sync"), spec)
    handler.dump({"actor": engine}, ac.StepInfo(0, 1, 1, spec.steps_per_epoch), force=True)
    handler.close()
    return root / "checkpoints" / "bench" / "bench" / "cli"


def timed(command: list[str]) -> float:
    """Seconds from the start of ``command`` to its exit; it must succeed."""
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(trial: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds per command, one run of each per round, in rotating order."""
    script = str(Path(sys.executable).with_name("areal-ckpt"))
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    names = list(COMMANDS)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            arguments = [name] if name == "--help" else [name, str(trial)]
            times[name].append(timed([script, *arguments]))
    return times


def report(times: dict[str, list[float]], mib: int, rounds: int) -> str:
    rows = [
        f"| `areal-ckpt {name}{'' if name == '--help' else ' TRIAL'}` | {statistics.median(values):.2f} | "
        f"{min(values):.2f}-{max(values):.2f} | < {COMMANDS[name]:.0f} s | "
        f"{'PASS' if statistics.median(values) < COMMANDS[name] else 'FAIL'} |"
        for name, values in times.items()
    ]
    return "\n".join(
        [
            "# The command line: time from a shell",
            "",
            f"Measured by `benchmarks/bench_cli.py --size {mib} --rounds {rounds}` on {machine_description()}, "
            f"{time.strftime('%Y-%m-%d')}: each command a new process, as typed, against a local trial holding two "
            f"HF exports and a recovery dump of a {mib} MiB fp32 model with its AdamW state; wall time from start to "
            "exit, median and range over the rounds, the commands' order rotating. Most of it is Python's imports: "
            "`--help`, and `list`, `inspect` and `verify` of a local trial, import none of torch, transformers, "
            "DeepSpeed or a cloud SDK (they read manifests and JSON metadata, and checksum files); those are "
            "imported only where a command uses them (`export`, a DeepSpeed tag, stock DCP, a URL).",
            "",
            "| command | median s | range s | goal | verdict |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = size_and_rounds(__doc__, 16, "MiB of fp32 weights in the trial's model").parse_args(argv)
    work = scratch_folder("bench-cli-")
    try:
        times = measure(make_trial(work, args.size), args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return publish(report(times, args.size, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
