"""`make demo-async`: asynchronous GRPO on digit addition, killed at a random instant, resumed.

A rollout thread samples with a copy of the policy while the trainer trains, at most
``max_head_offpolicyness`` versions ahead of it (AReaL's capacity rule), drawing its prompts
through an :class:`areal_ckpt.RolloutFrontier`; the trainer takes the first ``batch_size``
finished rollouts, steps, marks them consumed and dumps with ``rollout=frontier`` after every
step. Under ``areal-ckpt launch`` the first attempt SIGKILLs itself at a random instant (after
a random step, a random fraction of a second later: while a rollout is generating, while a dump
is written, or between); the relaunched job resumes the frontier with the weights. At the end
the report counts how many times each prompt was trained on in each epoch: exactly once.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.demo.report import plot, read_metrics
from areal_ckpt.demo.rl import Rollout, adapt_kl, grpo_loss, make_prompts, reward
from areal_ckpt.demo.tiny import build_model, build_tokenizer
from areal_ckpt.tools.launch import ATTEMPT_VARIABLE


@torch.no_grad()
def sample_group(
    model: Any, tokenizer: Any, prompt: dict[str, Any], group: int, new_tokens: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """``group`` completions of one prompt, sampled token by token from ``generator`` alone (the
    prompt's own seed: the same completions whenever the same weights sample it), with their
    rewards, group-normalized advantages and completion mask."""
    ids = tokenizer([prompt["text"]] * group, return_tensors="pt")["input_ids"]
    length = ids.shape[1]
    for _ in range(new_tokens):
        probabilities = F.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
    completions = tokenizer.batch_decode(ids[:, length:], skip_special_tokens=True)
    rewards = torch.tensor([reward(text, prompt["answer"]) for text in completions])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    mask = torch.zeros(group, ids.shape[1] - 1)
    mask[:, length - 1 :] = 1.0
    return {"sequences": ids, "mask": mask, "rewards": rewards, "advantages": advantages}


def kept_ledger(path: Path, start: int) -> None:
    """The ledger of trained prompts without the steps at or after ``start``: a resumed run
    trains those again (the killed run's steps after its last dump are gone with it)."""
    lines = path.read_text().splitlines() if path.exists() else []
    kept = "".join(f"{line}\n" for line in lines if json.loads(line)["step"] < start)
    path.with_suffix(".tmp").write_text(kept)
    path.with_suffix(".tmp").replace(path)


def trained_per_epoch(path: Path, prompts: int, epochs: int) -> list[str]:
    """One line per epoch: how many of its prompts were trained on once, never, more often."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        for key in json.loads(line)["keys"]:
            counts[key] = counts.get(key, 0) + 1
    lines = []
    for epoch in range(epochs):
        times = [counts.get(f"{epoch}:{index}", 0) for index in range(prompts)]
        verdict = "every prompt exactly once" if set(times) == {1} else "NOT exactly once"
        lines.append(
            f"epoch {epoch}: {times.count(1)} of {prompts} prompts trained on once, {times.count(0)} skipped, "
            f"{sum(1 for n in times if n > 1)} repeated: {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo.async_grpo", description=__doc__)
    parser.add_argument("--config", default="configs/demo-async.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. demo.epochs=1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
    cfg = ac.load_config(args.config, args.overrides)
    demo = (yaml.safe_load(Path(args.config).read_text()) or {}).get("demo", {})
    for override in args.overrides:  # demo.* overrides (the config loader validates the rest)
        key, _, value = override.partition("=")
        if key.startswith("demo."):
            demo[key.removeprefix("demo.")] = yaml.safe_load(value)
    seed, batch, group, stale = demo["seed"], demo["batch_size"], demo["group_size"], demo["max_head_offpolicyness"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    policy = build_model(len(tokenizer))
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    behaviour = copy.deepcopy(policy).eval().requires_grad_(False)  # the rollout side's copy
    prompts = [
        {"id": i, "text": text, "answer": answer}
        for i, (text, answer) in enumerate(make_prompts(demo["dataset_size"], seed))
    ]
    dataset: Any = prompts  # a list is a map-style dataset
    sampler: DistributedSampler[dict[str, Any]] = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=seed
    )
    loader = StatefulDataLoader(prompts, batch_size=batch, sampler=sampler, collate_fn=list)
    frontier = ac.RolloutFrontier(loader, epochs=demo["epochs"], identity=lambda prompt: prompt["id"], seed=seed)
    total = len(prompts) * demo["epochs"] // batch
    ft_spec = ac.FinetuneSpec(total_train_epochs=1, dataset_size=total * batch, train_batch_size=batch)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=demo["lr"])
    engines = {"actor": ac.TorchEngine(policy, optimizer=optimizer), "ref": ac.TorchEngine(reference)}
    recover = ac.RecoverHandler(cfg.recover, ft_spec)
    reports = Path(cfg.recover.fileroot) / "reports" / cfg.recover.experiment_name / cfg.recover.trial_name
    reports.mkdir(parents=True, exist_ok=True)
    ledger = reports / "trained.jsonl"

    info = recover.load(engines, rollout=frontier)
    start = 0 if info is None else info.last_step_info.global_step + 1
    kl_coef = demo["kl_coef"] if info is None else info.client_state["kl_coef"]
    counts = frontier.counts()
    print(
        "fresh start"
        if info is None
        else f"resumed after step {start - 1}: {counts['finished']} finished rollouts "
        f"back in the buffer, {counts['queued']} prompts that were in flight to generate again first",
        flush=True,
    )
    kept_ledger(ledger, start)
    frontier.set_version(start)
    behaviour.load_state_dict(policy.state_dict())
    weights_lock, stop = threading.Lock(), threading.Event()

    def rollouts() -> None:
        while not stop.is_set():
            if frontier.capacity(batch, stale) <= 0:
                time.sleep(0.005)
                continue
            try:
                key, prompt = frontier.next()
            except StopIteration:
                return
            generator = torch.Generator().manual_seed(frontier.seed_of(key))
            with weights_lock:
                version = frontier.version
                trajectory = sample_group(behaviour, tokenizer, prompt, group, demo["new_tokens"], generator)
            time.sleep(demo["rollout_seconds"])  # an inference server takes its time
            frontier.finished(key, {**trajectory, "version": version})

    crash, crash_step = threading.Event(), -1
    if os.environ.get(ATTEMPT_VARIABLE) == "0":  # the launcher's first attempt: killed at a random instant
        chance = random.Random(os.urandom(8))
        crash_step, delay = chance.randrange(max(1, start), total - 2), chance.uniform(0, 0.3)

        def kill() -> None:
            crash.wait()
            time.sleep(delay)
            print(f"simulating a crash: SIGKILL {delay:.2f} s after step {crash_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    worker = threading.Thread(target=rollouts, daemon=True)
    worker.start()
    with open(reports / "metrics.jsonl", "a") as metrics:
        for step in range(start, total):
            while len(frontier.buffered()) < batch:
                if not worker.is_alive():
                    raise RuntimeError(f"the rollout thread ended with {frontier.counts()} before step {step}")
                time.sleep(0.002)
            chosen = frontier.buffered()[:batch]
            rollout = Rollout(
                *(torch.cat([t[name] for _, t in chosen]) for name in ("sequences", "mask", "rewards", "advantages"))
            )
            loss, kl = grpo_loss(policy, reference, rollout, kl_coef)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            kl_coef = adapt_kl(kl_coef, kl, demo["kl_target"])
            keys = [key for key, _ in chosen]
            frontier.consumed(keys)
            with open(ledger, "a") as handle:
                handle.write(json.dumps({"step": step, "keys": keys}) + "\n")
            staleness = step - min(int(t["version"]) for _, t in chosen)
            with weights_lock:
                behaviour.load_state_dict(policy.state_dict())
                frontier.set_version(step + 1)
            dumped = recover.dump(
                engines, ac.StepInfo(0, step, step, total), client_state={"kl_coef": kl_coef}, rollout=frontier
            )
            seconds = recover.last_metrics["time/saving"] if dumped else None
            record = {"pid": os.getpid(), "global_step": step, "loss": float(loss.detach()).hex(), "kl": kl,
                      "reward": float(rollout.rewards.mean()), "recover_seconds": seconds, "staleness": staleness}  # fmt: skip
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            now = frontier.counts()
            print(
                f"step {step:2d} loss {float(loss.detach()):.4f} reward {record['reward']:.3f}; rollouts up to "
                f"{staleness} version(s) old; {now['generating']} generating, {now['finished']} finished waiting",
                flush=True,
            )
            if step == crash_step:
                crash.set()
    stop.set()
    worker.join()
    recover.close()
    print("\nprompts trained on, per epoch (each prompt should be trained on exactly once per epoch):")
    print("\n".join(trained_per_epoch(ledger, len(prompts), demo["epochs"])))
    plot(read_metrics(reports / "metrics.jsonl"), reports / "report.png")
    print(f"plot of reward and KL, with the kill and the resume: {reports / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
