"""`make bench` (fifth part): recovery dumps of a LoRA run, the frozen base stored once.

One process trains LoRA adapters (peft, r=16 on the attention projections, AdamW) on a frozen
Qwen2-shaped base. Each round starts a fresh trial and makes two synchronous, durable dumps
one training step apart: the first writes everything (the base, the adapters, their optimizer
state), as every dump did before the base was stored once; the second hard-links the base from
the first and writes the rest. The ratio is first over second, per round, for seconds and
bytes written; reported as the median and the range over the rounds.

    python benchmarks/bench_lora.py --size 400 --rounds 5 --out docs/benchmarks-lora.md
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import torch
from common import machine_description, model_of_size, publish, scratch_folder, size_and_rounds, state_bytes
from peft import LoraConfig, get_peft_model

import areal_ckpt as ac

TOKENS = torch.arange(32).reshape(2, 16)


def measure(mib: int, rounds: int) -> tuple[int, int, list[dict[str, float]]]:
    """(base bytes, adapter bytes, one row per round: seconds and bytes of both dumps)."""
    model = get_peft_model(
        model_of_size(mib, torch.float32), LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    engine = ac.TorchEngine(model, optimizer)
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=2)
    work = scratch_folder("bench-lora-")
    rows = []
    try:
        for index in range(rounds):
            config = ac.RecoverConfig(
                experiment_name="bench", trial_name=f"round{index}", fileroot=str(work), user="bench", mode="sync"
            )
            handler = ac.RecoverHandler(config, spec)
            row: dict[str, float] = {}
            for dump in ("first", "later"):
                model(input_ids=TOKENS, labels=TOKENS).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step = ac.StepInfo(epoch=0, epoch_step=len(row), global_step=len(row), steps_per_epoch=500)
                handler.dump(engine, step, force=True)
                row[f"{dump} seconds"] = handler.last_metrics["time/saving"]
                row[f"{dump} bytes"] = handler.last_metrics["bytes"]
            handler.close()
            rows.append(row)
            shutil.rmtree(work / "checkpoints" / "bench" / "bench" / f"round{index}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    adapters = sum(p.numel() * p.element_size() for p in trained)
    return state_bytes(model) - adapters, adapters, rows


def _ratio(rows: list[dict[str, float]], what: str) -> str:
    ratios = [row[f"first {what}"] / row[f"later {what}"] for row in rows]
    return f"{statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f})"


def report(base: int, adapters: int, rows: list[dict[str, float]], mib: int, rounds: int) -> str:
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return (
        "\n".join(
            [
                "# LoRA: the frozen base stored once per trial",
                "",
                f"Measured by `benchmarks/bench_lora.py --size {mib} --rounds {rounds}` on {machine_description()}, "
                f"{time.strftime('%Y-%m-%d')}: one process, fp32, a Qwen2-shaped base of {base / 2**20:.0f} MiB with "
                f"LoRA adapters of {adapters / 2**20:.1f} MiB (r=16 on q/k/v/o), AdamW on the adapters; synchronous "
                "dumps, durable on return. The first dump of a trial writes everything (what every dump wrote before "
                "the base was stored once); a later dump links the base and writes the adapters, their two moments "
                "and the small files. Medians over the rounds; ratios per round, median and range.",
                "",
                "| dump | seconds | bytes written |",
                "| --- | --- | --- |",
                f"| first (everything) | {median['first seconds']:.2f} | {median['first bytes'] / 2**20:.1f} MiB |",
                f"| later (base linked) | {median['later seconds']:.3f} | {median['later bytes'] / 2**20:.2f} MiB |",
                f"| first / later | {_ratio(rows, 'seconds')} | {_ratio(rows, 'bytes')} |",
                "",
                f"Adapters and their two moments are {3 * adapters / 2**20:.2f} MiB: a later dump writes "
                f"{median['later bytes'] / (3 * adapters):.2f}x that (the rest is the optimizer's step counters, the "
                "records' framing and the JSON files). Its seconds include the fingerprint of the base (one CRC-32 "
                "pass over its bytes in memory), which is what tells a dump that the base did not change, and the "
                "check of the base's files before they are linked (one CRC-32 pass over them as stored, from the "
                "page cache here), so that a file that rotted on disk is written afresh instead of linked into "
                "every later dump.",
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = size_and_rounds(__doc__, 400, "MiB of fp32 base weights").parse_args(argv)
    base, adapters, rows = measure(args.size, args.rounds)
    return publish(report(base, adapters, rows, args.size, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
