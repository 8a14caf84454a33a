"""A small training job that recovers itself; run by the recovery tests as a real process.

Single process (`python recover_job.py ...`) or under torchrun with FSDP2 (`--wrap fsdp2`).
It follows the rules in docs/recovery.md: a DistributedSampler with a seed and set_epoch, a
dataloader with its own generator, and resume from ``info.last_step_info.next()``. Dropout,
AdamW and a warm-up + cosine schedule make every piece of state matter. It appends each step's
loss (and the intra-op thread count it ran with) to ``{out}/losses-rank{r}.jsonl`` and, when it finishes, writes its final weights and
optimizer state to ``{out}/final-rank{r}.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model, warmup_cosine

VOCAB = 48
DATASET = 32
BATCH = 4
EPOCHS = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fileroot", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trial", default="bitexact")
    parser.add_argument("--wrap", choices=["none", "fsdp2", "ddp", "zero0", "zero1", "zero2", "zero3"], default="none")
    parser.add_argument("--freq-steps", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL this process after step K")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda: deterministic algorithms on)")
    parser.add_argument("--mode", choices=["on", "sync", "async"], default="on")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) on a frozen base")
    parser.add_argument("--staging-dir", help="staging_dir (fileroot on object storage): rank r uses {this}/node{r}")
    parser.add_argument("--local-dir", help="local_dir (a tiered trial): rank r uses {this}/node{r}")
    parser.add_argument("--local-replicas", type=int, default=0, help="recover.local_replicas (with --local-dir)")
    parser.add_argument("--upload-every", type=int, default=1, help="recover.upload_every (with --local-dir)")
    parser.add_argument("--wait-after-dumps", action="store_true", help="RecoverHandler.wait() after every dump")
    parser.add_argument("--wait-before-kill", action="store_true", help="RecoverHandler.wait() before --kill-at")
    parser.add_argument("--hold", help="touch {this}/held-rank{r} at --hold-at, then wait for {this}/go")
    parser.add_argument("--hold-at", type=int, default=-1, help="-1: after the load; K: after step K's dump")
    parser.add_argument("--environment", default="{}", help="JSON object of environment variables to set first")
    parser.add_argument("--preemption-signals", default="", help="recover.preemption_signals, comma-separated")
    parser.add_argument("--signal-at", type=int, default=-1, help="send --signal to this process during step K")
    parser.add_argument("--signal-in-dump-at", type=int, default=-1, help="send it while step K's dump is taken")
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--signal-ranks", default="all", help="'all' or the comma-separated ranks that get it")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every step")
    parser.add_argument("--ask", action="store_true", help="the loop reads recover.preempted and stops on it")
    return parser.parse_args(argv)


class SignalInDump:
    """A component whose state is taken while a dump is written: armed, it sends the signal then."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig, self.armed = sig, False

    def state_dict(self) -> dict:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), self.sig)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def run(rank: int, world_size: int, argv: list[str]) -> None:
    """Entry point for a process started by tests/distributed.py (group already initialized)."""
    train(parse(argv))


def hold(folder: str | None, rank: int) -> None:
    """With --hold: say this rank is held, then wait until the test says go (no timer races)."""
    if folder:
        (Path(folder) / f"held-rank{rank}").touch()
        while not (Path(folder) / "go").exists():
            time.sleep(0.01)


def main() -> None:
    """Entry point as a script, alone or under torchrun."""
    args = parse(None)
    if "RANK" in os.environ:  # FSDP2 on CUDA tensors needs NCCL's collectives
        torch_dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    try:
        train(args)
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    os.environ.update(json.loads(args.environment))  # a fork server's environment predates the test's
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    world = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    data_rng = torch.Generator().manual_seed(11)
    dataset = [torch.randint(0, VOCAB, (12,), generator=data_rng) for _ in range(DATASET)]
    model = build_model(VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden, attention_dropout=0.2)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, config)
    if args.device != "cpu":  # CUDA kernels are bitwise repeatable only with these (and CUBLAS_WORKSPACE_CONFIG)
        torch.use_deterministic_algorithms(True)
        model.to(args.device)
    if args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        base = model.get_base_model() if args.lora else model
        for layer in base.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif args.wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    model.train()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(3))
    ft_spec = ac.FinetuneSpec(total_train_epochs=EPOCHS, dataset_size=DATASET // world, train_batch_size=BATCH)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    scheduler = warmup_cosine(optimizer, warmup=3, total=ft_spec.total_train_steps)
    if args.wrap.startswith("zero"):
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(args.wrap[-1]), "stage3_param_persistence_threshold": 0},
        }
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        model, engine = ds_engine, ac.DeepSpeedEngine(ds_engine)
    else:
        engine = ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler)
    config = ac.RecoverConfig(
        experiment_name="exp",
        trial_name=args.trial,
        fileroot=args.fileroot,
        staging_dir=None if args.staging_dir is None else f"{args.staging_dir}/node{rank}",
        local_dir=None if args.local_dir is None else f"{args.local_dir}/node{rank}",
        local_replicas=args.local_replicas,
        upload_every=args.upload_every,
        user="tester",
        mode=args.mode,
        freq_steps=args.freq_steps,
        preemption_signals=tuple(name for name in args.preemption_signals.split(",") if name),
    )
    recover = ac.RecoverHandler(config, ft_spec)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # torchrun's restarts run clean
    signalled = args.signal_ranks == "all" or str(rank) in args.signal_ranks.split(",")
    in_dump = SignalInDump(signal.Signals[args.signal]) if args.signal_in_dump_at >= 0 else None

    info = recover.load(engine, dataloader=loader)
    if args.hold_at == -1:  # the test acts (e.g. stops the server) between the load and the first step
        hold(args.hold, rank)
    start = (
        info.last_step_info.next()
        if info
        else ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=ft_spec.steps_per_epoch)
    )
    noise_scale = info.client_state["noise_scale"] if info else 1.0
    losses = open(out / f"losses-rank{rank}.jsonl", "a")
    global_step = start.global_step
    for epoch in range(start.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        epoch_step = start.epoch_step if epoch == start.epoch else 0
        for batch in loader:
            batch = batch.to(args.device)
            # python, numpy and torch RNGs all feed the loss, so each must be restored exactly
            jitter = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = model(input_ids=batch, labels=batch).loss * (1 + jitter * noise_scale)
            if args.wrap.startswith("zero"):
                model.backward(loss)
                model.step()  # steps the optimizer and the LR scheduler
            else:
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            noise_scale *= 0.9
            losses.write(
                json.dumps({"step": global_step, "loss": loss.item().hex(), "threads": torch.get_num_threads()}) + "\n"
            )
            losses.flush()
            step_info = ac.StepInfo(
                epoch=epoch, epoch_step=epoch_step, global_step=global_step, steps_per_epoch=ft_spec.steps_per_epoch
            )
            time.sleep(args.step_seconds)
            if first_attempt and signalled and global_step == args.signal_at:
                os.kill(os.getpid(), signal.Signals[args.signal])  # arrives during the step, before its dump
            if first_attempt and signalled and global_step == args.signal_in_dump_at and in_dump is not None:
                in_dump.armed = True
            recover.dump(
                engine, step_info, evaluator=in_dump, dataloader=loader, client_state={"noise_scale": noise_scale}
            )
            if args.wait_after_dumps:
                recover.wait()
            if args.ask and recover.preempted:
                losses.close()
                recover.close()
                return
            if global_step == args.hold_at and first_attempt:  # the test acts knowing the job is mid-run
                hold(args.hold, rank)
            if global_step == args.kill_at and first_attempt:
                if args.wait_before_kill:
                    recover.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            epoch_step += 1
            global_step += 1
    recover.close()
    final = {}
    for name, tensor in engine.recover_template(with_optimizer_tensors=True).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        final[name] = local.detach().cpu().clone().contiguous()
    final["lr"] = torch.tensor([group["lr"] for group in optimizer.param_groups], dtype=torch.float64)
    if args.wrap.startswith("zero"):
        final["global_steps"] = torch.tensor([model.global_steps])
    save_file(final, out / f"final-rank{rank}.safetensors")


if __name__ == "__main__":
    main()
