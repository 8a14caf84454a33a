"""`make bench` (peers): our asynchronous dump and our load beside torch's own, on one state.

The state: a Llama (hidden 1024, 4 layers, vocab 16384) in fp32 with AdamW after one step
(about 1 GB: weights and two moments), one process in a gloo group of one. Each round runs every
contender once, in an order rotated between rounds, and each row is the median over rounds of a
ratio taken inside one round (so a slow round slows both sides of it), with its range:

- asynchronous save, ours (`RecoverHandler` mode `async`) against `dcp.async_save` with its
  default thread checkpointer, and with the process checkpointer and a shared-memory
  `DefaultStager` reused across saves (its first save, which starts the process, is not timed):
  the time the call blocks the loop, and the time until the save is complete (ours: committed
  and durable; torch's: its future done);
- the loop's slowdown while the save is written in the background (what ByteCheckpoint calls
  the checkpoint stall): three real training steps of this model (forward, backward, AdamW)
  started as the save returns, against the same three steps with no save, for our async dump
  and for torch's process checkpointer;
- loading the checkpoint again after a cold load (a job that crash-loops reloads the same
  checkpoint), ours against `dcp.load` of a `dcp.save` of the same state, and against our own cold
  load. "Cold": the files evicted from the page cache (fsync, then POSIX_FADV_DONTNEED). Ours
  loads again once the page-cache fill its cold load started in the background has finished
  (a restart takes seconds to start a process; the fill's wait is reported).

A ratio above 1 means ours is faster. `make bench` runs it from bench_async.py, into
docs/benchmarks-async.md; alone: `python benchmarks/bench_peers.py --rounds 7`.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import evict, machine_description, publish, scratch_folder
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

import areal_ckpt as ac
from areal_ckpt.formats import cache_fill

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=10**6, train_batch_size=1)
SAVERS = ("ours", "torch thread", "torch process")
STALL_STEPS = 3  # training steps timed right after a save returns: longer than either save's write here


def llama() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=16384,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer


class Trainer:
    """One real training step of the bench model: forward, backward, AdamW."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.tokens = torch.randint(0, 16384, (1, 64), generator=torch.Generator().manual_seed(1))

    def step(self) -> float:
        start = time.perf_counter()
        self.model(input_ids=self.tokens, labels=self.tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start


def step_info(step: int) -> ac.StepInfo:
    return ac.StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6)


def torch_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


class Contenders:
    """The three savers of one model and its optimizer, each writing under ``root``, and the
    training step they are timed against."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: Path) -> None:
        self.model, self.optimizer, self.root = model, optimizer, root
        self.trainer = Trainer(model, optimizer)
        self.engine = ac.TorchEngine(model, optimizer=optimizer)
        names = dict(experiment_name="bench", fileroot=str(root), user="bench", freq_steps=1)
        self.handler = ac.RecoverHandler(ac.RecoverConfig(trial_name="async", mode="async", **names), SPEC)
        self.stager = DefaultStager(StagingOptions(False, True, False, False))  # shared memory, reused
        self.saves = 0

    def folder(self) -> Path:
        self.saves += 1
        return self.root / f"torch-{self.saves}"

    def save(self, who: str, steps: int = 0) -> tuple[float, float, float]:
        """Seconds the call blocks, seconds until the save is complete, and seconds from the call
        to the end of ``steps`` training steps run right after it returns (the loop's time)."""
        start = time.perf_counter()
        folder = None
        if who == "ours":
            self.handler.dump(self.engine, step_info(self.saves), force=True)
            self.saves += 1
            done: Callable[[], bool] = lambda: not self.handler.saving_in_background  # noqa: E731
            finish: Callable[[], object] = self.handler.wait
        else:
            folder = self.folder()
            state = torch_state(self.model, self.optimizer)
            if who == "torch thread":
                future = dcp.async_save(state, checkpoint_id=str(folder))
            else:
                process = dcp.state_dict_saver.AsyncCheckpointerType.PROCESS
                response = dcp.async_save(
                    state, checkpoint_id=str(folder), async_checkpointer_type=process, async_stager=self.stager
                )
                future = getattr(response, "upload_completion", response)
            done, finish = future.done, future.result
        blocked = time.perf_counter() - start
        completed = None
        for _ in range(steps):
            self.trainer.step()
            if completed is None and done():
                completed = time.perf_counter() - start
        looped = time.perf_counter() - start
        while not done():
            time.sleep(0.002)
        finish()
        if completed is None:
            completed = time.perf_counter() - start
        if folder is not None:
            shutil.rmtree(folder)
        return blocked, completed, looped

    def close(self) -> None:
        self.handler.close()
        self.stager.close()


def load_ours(trial_root: Path, engine: ac.TorchEngine) -> None:
    config = ac.RecoverConfig(
        experiment_name="bench", trial_name="load", fileroot=str(trial_root), user="bench", mode="on"
    )
    handler = ac.RecoverHandler(config, SPEC)
    if handler.load(engine) is None:
        raise RuntimeError(f"{trial_root}: nothing loaded")
    handler.close()


def load_dcp(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = torch_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def run(rounds: int, workdir: Path) -> dict[str, Any]:
    model, optimizer = llama()
    state_bytes = sum(t.numel() * t.element_size() for t in torch_state(model, optimizer)["model"].values()) * 3
    contenders = Contenders(model, optimizer, workdir)
    trainer = contenders.trainer
    trainer.step()  # AdamW's moments exist from here on
    for who in SAVERS:  # warm-up: writers started, torch's checkpoint process spawned; not timed
        contenders.save(who)
    ours_trial = workdir / "load-root"
    sync = ac.RecoverHandler(
        ac.RecoverConfig(
            experiment_name="bench", trial_name="load", fileroot=str(ours_trial), user="bench", mode="sync"
        ),
        SPEC,
    )
    sync.dump(contenders.engine, step_info(0), force=True)
    sync.close()
    dcp_folder = workdir / "dcp-load"
    dcp.save(torch_state(model, optimizer), checkpoint_id=str(dcp_folder))
    samples: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    for round_index in range(rounds):
        gc.collect()
        order = SAVERS[round_index % 3 :] + SAVERS[: round_index % 3]
        for who in order:
            blocked, done, _ = contenders.save(who)
            record(f"{who} blocking", blocked)
            record(f"{who} complete", done)
        record("loop alone", sum(trainer.step() for _ in range(STALL_STEPS)))
        for who in ("ours", "torch process") if round_index % 2 == 0 else ("torch process", "ours"):
            record(f"loop during {who}", contenders.save(who, STALL_STEPS)[2])
        loads = [
            ("ours", lambda: load_ours(ours_trial, contenders.engine), ours_trial),
            ("dcp.load", lambda: load_dcp(dcp_folder, model, optimizer), dcp_folder),
        ]
        for name, load, folder in loads if round_index % 2 == 0 else loads[::-1]:
            evict(folder)
            record(f"{name} cold load", timed(load))
            if name == "ours":
                cpu = time.process_time()
                record("ours fill wait", timed(cache_fill.wait_for_fills))
                record("ours fill cpu", time.process_time() - cpu)
            record(f"{name} load again", timed(load))
        print(f"  round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
    contenders.close()
    return {"bytes": state_bytes, "samples": samples}


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _ratio_row(label: str, theirs: list[float], ours: list[float]) -> str:
    """A table row: both medians and the median (range) of the ratios taken round by round."""
    ratios = [t / o for t, o in zip(theirs, ours)]
    return f"| {label} | {statistics.median(ours):.3f} | {statistics.median(theirs):.3f} | {_spread(ratios)} |"


def report(result: dict[str, Any], machine: str, rounds: int) -> str:
    s = result["samples"]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}, torch {torch.__version__}: a Llama (hidden 1024, 4 "
        f"layers, vocab 16384), fp32 with AdamW, {result['bytes'] / 1e9:.2f} GB of state; {rounds} interleaved "
        "rounds; medians, a ratio's median taken over its rounds (range in brackets). Above 1: ours is faster.",
        "",
        "| measurement | ours (s) | theirs (s) | theirs / ours |",
        "| --- | --- | --- | --- |",
    ]
    for who in ("torch thread", "torch process"):
        for kind in ("blocking", "complete"):
            lines.append(
                _ratio_row(f"async save, {kind}: `dcp.async_save`, {who}", s[f"{who} {kind}"], s[f"ours {kind}"])
            )
    lines.append(_ratio_row("load again after a cold load: `dcp.load`", s["dcp.load load again"], s["ours load again"]))
    lines.append(_ratio_row("cold load: `dcp.load`", s["dcp.load cold load"], s["ours cold load"]))
    lines.append(_ratio_row("load again against our own cold load", s["ours cold load"], s["ours load again"]))
    lines += [
        "",
        f"Our cold load's background page-cache fill went on {statistics.median(s['ours fill wait']):.3f} s "
        f"after the load returned (median; range {min(s['ours fill wait']):.3f}-{max(s['ours fill wait']):.3f}), "
        f"using {statistics.median(s['ours fill cpu']):.3f} s of CPU meanwhile.",
    ]
    alone = statistics.median(s["loop alone"])
    lines += [
        "",
        f"| the loop: {STALL_STEPS} training steps (forward, backward, AdamW) | seconds | x alone |",
        "| --- | --- | --- |",
        f"| alone | {alone:.3f} | 1.00x |",
    ]
    for who, label in (("ours", "our async dump"), ("torch process", "torch's process checkpointer")):
        during = statistics.median(s[f"loop during {who}"])
        lines.append(
            f"| right after {label} returned (its blocking time included) | {during:.3f} | {during / alone:.2f}x |"
        )
    stall = _spread([t / o for t, o in zip(s["loop during torch process"], s["loop during ours"])])
    lines += [
        "",
        f"The loop during a save, torch's process checkpointer / ours: {stall} (above 1: ours slows it less).",
    ]
    lines += ["", DURABILITY, "", READING]
    return "\n".join(lines)


DURABILITY = """What "complete" means on each side, read in torch 2.13's code: ours is durable (every file and
folder fsynced, then the commit record created once). torch's `FileSystemWriter.finish`
(`torch/distributed/checkpoint/filesystem.py`) fsyncs each data file and `.metadata.tmp`, deletes
an existing `.metadata`, then renames the temporary file into place without fsyncing the folder:
after a power loss the rename may be gone (a folder of data files with no metadata), and a save
over an earlier checkpoint passes through a moment with no `.metadata` at all.
`HuggingFaceStorageWriter(enable_consolidation=True)` writes the shards under `sharded/` with that
writer; `consolidate_safetensors_files` (`_consolidate_hf_safetensors.py`) then writes the
consolidated files and their index without any fsync, and leaves `sharded/` behind."""


READING = """### Reading the peer rows

- Blocking: ours copies the state into shared memory that a writer process reads; torch's thread
  checkpointer copies it into new CPU memory at every save, its process checkpointer into a
  shared-memory stager reused across saves: the design closest to ours, and the closest row.
- Until complete: our writer process runs at a lower priority (niceness +10, one thread), so it
  gives the cores to the training loop and stretches while the loop runs; in these rows the
  loop waits. The loop's rows time three real training steps started as the save returns.
- Load again: our load reads a file around the page cache (O_DIRECT) unless at least half of it
  is cached (mincore), which is faster cold (the cold-load row). Once every rank has loaded, a
  background thread brings the files it read that way into the cache (sendfile to /dev/null:
  the kernel reads, nothing is copied to the process), within a quarter of the memory the
  kernel reports available; so the load after it is served from memory, as `dcp.load`'s
  second load is. The fill takes about as long as a cold read of the same files (the line
  below the table); here that is well within the seconds a restarted process takes to start."""


def measure(rounds: int) -> str:
    """Run the comparison (in a gloo group of one, started here) and return its report."""
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    workdir = scratch_folder("bench-peers-")
    try:
        result = run(rounds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(result, machine_description(), rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return publish(measure(args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
