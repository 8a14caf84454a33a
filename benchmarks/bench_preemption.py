"""`make bench` (preemption): from a preemption signal to the job's exit, the figure a grace period
is set by (Kubernetes' terminationGracePeriodSeconds, SLURM's --signal lead time).

A training process (a Qwen2-shaped model with AdamW, real forward / backward / step, one process,
`recover.preemption_signals: [SIGTERM]`, no periodic dump) is sent SIGTERM during its third step;
it finishes the step, every rank dumps it (forced, durable), and it exits with 143. Measured: the
seconds from the signal to the exit, for a synchronous and an asynchronous dump, interleaved over
the rounds, beside one training step's time; medians and ranges.

    python benchmarks/bench_preemption.py --size 200 --rounds 3 --out docs/benchmarks-preemption.md
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine_description, publish, scratch_folder, size_and_rounds

MODES = ("sync", "async")


def child(root: str, mode: str, mib: int) -> None:
    """The training job: prints each step's seconds; dumps and exits on SIGTERM."""
    import torch
    from common import model_of_size, state_bytes

    import areal_ckpt as ac

    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=2000, train_batch_size=2)
    config = ac.RecoverConfig(
        experiment_name="bench", trial_name=mode, fileroot=root, user="bench", mode=mode,
        freq_steps=10_000, preemption_signals=["SIGTERM"],
    )  # fmt: skip
    handler = ac.RecoverHandler(config, spec)
    engine = ac.TorchEngine(model, optimizer)
    tokens = torch.arange(64).reshape(2, 32)
    print(f"state {3 * state_bytes(model)}", flush=True)  # weights and two AdamW moments
    for step in range(spec.total_train_steps):
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} {time.perf_counter() - start:.3f}", flush=True)
        handler.dump(engine, ac.StepInfo(0, step, step, spec.steps_per_epoch))


def one_round(mode: str, mib: int, work: Path) -> tuple[float, float, int]:
    """(signal to exit, one step, state bytes) of one preempted run."""
    root = work / f"{mode}-{time.monotonic_ns()}"
    command = [sys.executable, __file__, "--child", mode, str(root), str(mib)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
    assert job.stdout is not None
    state, steps = 0, []
    for line in job.stdout:
        word, *values = line.split()
        if word == "state":
            state = int(values[0])
        elif word == "step":
            steps.append(float(values[1]))
            if len(steps) == 2:
                time.sleep(min(steps) / 2)  # into the third step
                sent = time.perf_counter()
                job.send_signal(signal.SIGTERM)
                break
    code = job.wait(timeout=600)
    took = time.perf_counter() - sent
    assert code == 128 + signal.SIGTERM, f"{mode}: exit status {code}, not 143"
    shutil.rmtree(root, ignore_errors=True)
    return took, statistics.median(steps), state


def report(results: dict[str, list[tuple[float, float, int]]], mib: int, rounds: int) -> str:
    state = results["sync"][0][2]
    rows = []
    for mode, measured in results.items():
        exits, steps = [m[0] for m in measured], [m[1] for m in measured]
        rows.append(
            f"| {mode} | {statistics.median(exits):.2f} | {min(exits):.2f}-{max(exits):.2f} | "
            f"{statistics.median(steps):.2f} |"
        )
    return "\n".join(
        [
            "# Preemption: from the signal to the exit",
            "",
            f"Measured by `benchmarks/bench_preemption.py --size {mib} --rounds {rounds}` on {machine_description()}, "
            f"{time.strftime('%Y-%m-%d')}: one process training a Qwen2-shaped fp32 model of {mib} MiB with AdamW "
            f"({state / 2**20:.0f} MiB of state with its two moments) on the CPU, `recover.preemption_signals: "
            "[SIGTERM]`, no periodic dump; SIGTERM sent half a step into its third step. Seconds from the signal to "
            "the process's exit (status 143): the rest of the step, the forced dump made durable (written in the "
            "training process in both modes: it is waited for anyway), the handler closed, Python's exit. Medians and ranges "
            "over the rounds, the two modes interleaved.",
            "",
            "| dump mode | signal to exit (s) | range (s) | one training step (s) |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            "Set the grace period (Kubernetes' `terminationGracePeriodSeconds`, SLURM's `--signal` lead time, "
            "`KillWait`) above the slowest step plus this, with room: the disk of a busy node is slower than "
            "this idle one's. In `async` mode the job "
            "exits as fast: no background writer has to start for its last dump.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[2], argv[1], int(argv[3]))
        return 0
    args = size_and_rounds(__doc__, 200, "MiB of fp32 weights").parse_args(argv)
    work = scratch_folder("bench-preemption-")
    results: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in MODES}
    try:
        for index in range(args.rounds):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                results[mode].append(one_round(mode, args.size, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return publish(report(results, args.size, args.rounds), args.out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
