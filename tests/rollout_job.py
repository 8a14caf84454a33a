"""An asynchronous RL job in miniature, run by the rollout-frontier tests as real processes.

One rollout thread per rank draws prompts through a :class:`areal_ckpt.RolloutFrontier`
(a DistributedSampler with a seed, a StatefulDataLoader), generates one at a time while the
trainer trains (at most ``STALENESS`` versions ahead of it, AReaL's capacity rule), and reports
each trajectory; the trainer takes the first ``BATCH`` finished ones, steps, marks them
consumed, appends them to ``{out}/ledger-rank{r}.jsonl`` and dumps with ``rollout=``. A
generation here depends on the prompt and its seed only (there is no policy to sample from),
and one thread generates in draw order, so the run is deterministic: its final weights can be
compared bit for bit with a run that was never killed. On a resume the ledger keeps only the
steps the loaded checkpoint holds (a step after it was trained in a timeline that is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac

PROMPTS = 24
BATCH = 4
EPOCHS = 2
STALENESS = 1


def run(rank: int, world_size: int, argv: list[str]) -> None:
    """Entry point for a process started by tests/distributed.py."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fileroot", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--generate-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    train(Path(args.fileroot), Path(args.out), args.generate_seconds, rank, world_size)


def _keep_ledger(path: Path, start: int) -> None:
    """The ledger without the steps at or after ``start`` (rewritten whole, then renamed)."""
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if json.loads(line)["step"] < start]
    path.with_suffix(".tmp").write_text("".join(f"{line}\n" for line in kept))
    path.with_suffix(".tmp").rename(path)


def train(fileroot: Path, out: Path, generate_seconds: float, rank: int, world: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = [{"id": index, "features": [index % 7, index % 5, index % 3]} for index in range(PROMPTS)]
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
    loader = StatefulDataLoader(data, batch_size=2, sampler=sampler, collate_fn=list)
    frontier = ac.RolloutFrontier(loader, epochs=EPOCHS, identity=lambda prompt: prompt["id"], seed=3)
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(4, 1)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = ac.TorchEngine(model, optimizer=optimizer)
    steps = PROMPTS // world * EPOCHS // BATCH
    spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=steps * BATCH, train_batch_size=BATCH)
    config = ac.RecoverConfig(
        experiment_name="exp", trial_name="async", fileroot=str(fileroot), mode="on", freq_steps=1, user="tester"
    )
    recover = ac.RecoverHandler(config, spec)
    info = recover.load(engine, rollout=frontier)
    start = 0 if info is None else info.last_step_info.global_step + 1
    ledger = out / f"ledger-rank{rank}.jsonl"
    _keep_ledger(ledger, start)
    frontier.set_version(start)
    stop = threading.Event()

    def rollouts() -> None:
        while not stop.is_set():
            if frontier.capacity(BATCH, STALENESS) <= 0:
                time.sleep(0.002)
                continue
            try:
                key, prompt = frontier.next()
            except StopIteration:
                return
            noise = torch.Generator().manual_seed(frontier.seed_of(key))
            features = torch.tensor([*prompt["features"], 1.0])
            reward = features.sum().reshape(1) / 10 + torch.rand(1, generator=noise)
            time.sleep(generate_seconds)
            frontier.finished(key, {"features": features, "reward": reward, "issued_at": frontier.version})

    worker = threading.Thread(target=rollouts, daemon=True)
    worker.start()
    for step in range(start, steps):
        while len(frontier.buffered()) < BATCH:
            if not worker.is_alive():
                raise RuntimeError(f"rank {rank}: the rollout thread ended with {frontier.counts()} at step {step}")
            time.sleep(0.002)
        batch = frontier.buffered()[:BATCH]
        features = torch.stack([trajectory["features"] for _, trajectory in batch])
        rewards = torch.cat([trajectory["reward"] for _, trajectory in batch])
        loss = ((model(features).squeeze(1) - rewards) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        keys = [key for key, _ in batch]
        frontier.consumed(keys)
        with open(ledger, "a") as handle:
            handle.write(json.dumps({"step": step, "keys": keys}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        frontier.set_version(step + 1)
        recover.dump(engine, ac.StepInfo(0, step, step, steps), rollout=frontier)
    stop.set()
    worker.join()
    recover.close()
    module = model.module if world > 1 else model
    save_file(
        {name: value.detach().clone() for name, value in module.state_dict().items()},
        out / f"final-rank{rank}.safetensors",
    )
    if torch_dist.is_initialized():
        torch_dist.barrier()
