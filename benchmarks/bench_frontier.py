"""`make bench` (twelfth part): what a rollout frontier adds to a recovery dump.

One process trains a Qwen2-shaped model one step with AdamW, then one RecoverHandler (``mode:
on``: synchronous on the CPU, so the caller is blocked for the whole dump) dumps it with and
without ``rollout=``: a frontier holding 256 finished, unconsumed trajectories of 2048 tokens
each (token ids int64, logprobs and advantages fp32, a loss mask, a reward and a version), as
an async GRPO step leaves it. The two kinds alternate in pairs, and a control pairs a plain dump
with a plain dump (the spread a ratio has here with nothing changed). Ratio: dump with the
frontier over the dump without, per pair, median and range.

    python benchmarks/bench_frontier.py --size 135 --rounds 6 --out docs/benchmarks-frontier.md
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import torch
from common import machine_description, model_of_size, publish, scratch_folder, size_and_rounds
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.generations.store import wait_for_deletions
from areal_ckpt.state.frontier_files import encode_frontier

TOKENS = torch.arange(32).reshape(2, 16)
TRAJECTORIES = 256
LENGTH = 2048


def full_frontier() -> ac.RolloutFrontier:
    """A frontier with :data:`TRAJECTORIES` finished trajectories of :data:`LENGTH` tokens."""
    prompts = [{"id": index} for index in range(TRAJECTORIES)]
    sampler = DistributedSampler(prompts, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = StatefulDataLoader(prompts, batch_size=16, sampler=sampler, collate_fn=list)
    frontier = ac.RolloutFrontier(loader, identity=lambda prompt: prompt["id"])
    noise = torch.Generator().manual_seed(0)
    for key, _ in frontier:
        frontier.finished(
            key,
            {
                "input_ids": torch.randint(0, 150_000, (LENGTH,), generator=noise),
                "logprobs": torch.randn(LENGTH, generator=noise),
                "advantages": torch.randn(LENGTH, generator=noise),
                "loss_mask": torch.ones(LENGTH, dtype=torch.bool),
                "rewards": torch.rand(1, generator=noise),
                "versions": torch.zeros(LENGTH, dtype=torch.int32),
            },
        )
    return frontier


def measure(mib: int, rounds: int, pause: float) -> tuple[int, dict[str, int], list[dict[str, float]]]:
    """(state bytes, the frontier's files' bytes by name, one row per round: each dump's seconds)."""
    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    engine = ac.TorchEngine(model, optimizer)
    frontier = full_frontier()
    added = {name.rsplit(".", 1)[1]: len(data) for name, data in encode_frontier(frontier.snapshot(), 0).items()}
    size = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=2)
    work = scratch_folder("bench-frontier-")
    config = ac.RecoverConfig(experiment_name="bench", trial_name="t", fileroot=str(work), user="bench", mode="on")
    handler = ac.RecoverHandler(config, spec)
    rows, step = [], 0
    try:
        for index in range(rounds + 1):  # the first pair makes the save plan: not counted
            row: dict[str, float] = {}
            order = ("plain", "frontier", "control") if index % 2 == 0 else ("frontier", "plain", "control")
            for what in order:
                start = time.perf_counter()
                handler.dump(
                    engine,
                    ac.StepInfo(0, step, step, 500),
                    rollout=frontier if what == "frontier" else None,
                    force=True,
                )
                row[what] = time.perf_counter() - start
                step += 1
                wait_for_deletions()
                time.sleep(pause)
            if index:
                rows.append(row)
        handler.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return size, added, rows


def render(size: int, added: dict[str, int], rows: list[dict[str, float]]) -> str:
    ratios = [row["frontier"] / row["plain"] for row in rows]
    control = [row["control"] / row["plain"] for row in rows]
    seconds = {what: [row[what] for row in rows] for what in ("plain", "frontier")}
    return "\n".join(
        [
            "# A rollout frontier in a recovery dump",
            "",
            f"{time.strftime('%Y-%m-%d')}: {machine_description()}; one process, fp32, a Qwen2-shaped model and its "
            f"AdamW state, {size / 2**20:.0f} MiB; a frontier of {TRAJECTORIES} finished trajectories of {LENGTH} "
            f"tokens (ids, logprobs, advantages, loss mask, reward, versions). {len(rows)} rounds, each a dump "
            "without and one with the frontier (order alternating) and a control dump without; the caller is "
            "blocked for the whole dump (synchronous on the CPU). Regenerate: "
            "`cd benchmarks && python bench_frontier.py --out ../docs/benchmarks-frontier.md`.",
            "",
            "| dump | median s | range s |",
            "| --- | --- | --- |",
            *(
                f"| {what} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |"
                for what, values in (("without a frontier", seconds["plain"]), ("with it", seconds["frontier"]))
            ),
            "",
            f"Blocking time with the frontier over without (per round): median {statistics.median(ratios):.2f}x, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}x (goal <= 1.1x); the control (a plain dump over a plain "
            f"dump): median {statistics.median(control):.2f}x, range {min(control):.2f}-{max(control):.2f}x. "
            f"The frontier adds {sum(added.values()) / 2**20:.1f} MiB to the dump "
            f"({sum(added.values()) / size * 100:.1f}% of this state): its tensors, "
            f"{added['safetensors'] / 2**20:.1f} MiB, and {added['json'] / 2**10:.0f} KiB of JSON "
            f"({added['json'] / TRAJECTORIES:.0f} bytes per prompt).",
            "",
        ]
    )


def main() -> int:
    parser = size_and_rounds(__doc__, 135, "MiB of fp32 weights (the state is about three times that)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between two dumps (a job's steps)")
    args = parser.parse_args()
    size, added, rows = measure(args.size, args.rounds, args.pause)
    return publish(render(size, added, rows), args.out)


if __name__ == "__main__":
    sys.exit(main())
