"""An AReaL RL trainer, shape for shape, running on areal_ckpt: only the imports differ.

The calls are copied in shape from AReaL's ``areal/trainer/rl_trainer.py`` and
``sft_trainer.py``: ``FinetuneSpec`` and ``StepInfo`` built as AReaL builds them; ``Saver``,
``RecoverHandler``; ``load(actor, saver, evaluator, stats_logger, dataloader,
inference_engine=..., weight_update_meta=...)`` and ``dump(to_save, step_info, saver,
evaluator, stats_logger, dataloader, tokenizer=..., processor=...)`` by position;
``saver.save(actor, epoch, step, global_step, tokenizer=..., processor=...)``, ``is_async``,
``maybe_wait_for_staging()``; ``check_if_recover(config, run_id)``. The actor is an AReaL-shaped
engine (``.model`` under FSDP2, ``.optimizer``, ``.lr_scheduler``, ``.config.path``, and the
weight-update methods); the rollout engine is a real in-process generator holding its own copy of
the model, so every step's data depends on the weights it was last sent. The evaluator and stats
logger keep state shaped like AReaL's.

Run under torchrun (gloo). Rank 0 SIGKILLs itself after ``--kill-at`` in the first attempt under
``areal-ckpt launch``. Each rank appends what it saw to ``{out}/steps-rank{r}.jsonl``, records
what a resume restored in ``{out}/resume-rank{r}.json``, and writes its final model and optimizer
shards to ``{out}/final-rank{r}.safetensors``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

# The only lines that differ from an AReaL trainer: where these names come from.
from areal_ckpt import FinetuneSpec, RecoverHandler, Saver, StepInfo, check_if_recover, load_config
from areal_ckpt.demo.tiny import build_model, warmup_cosine
from areal_ckpt.tools.launch import ATTEMPT_VARIABLE

PROMPTS = 24
PROMPT_LENGTH = 5
NEW_TOKENS = 3


@dataclasses.dataclass
class TrainEngineConfig:
    """The part of AReaL's TrainEngineConfig the Saver reads: the base model folder."""

    path: str


@dataclasses.dataclass
class WeightUpdateMeta:
    """AReaL's WeightUpdateMeta, as far as a load uses it."""

    type: str = "disk"
    version: int | None = None

    def with_version(self, version: int) -> WeightUpdateMeta:
        return dataclasses.replace(self, version=version)


class InProcessRollout:
    """A rollout engine that serves ``generate`` from its own copy of the policy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.version = 0
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def set_version(self, version: int) -> None:
        self.version = version

    def receive(self, state: dict[str, torch.Tensor]) -> None:
        assert self.paused, "weights must only change while generation is paused"
        self.model.load_state_dict(state)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor) -> torch.Tensor:
        assert not self.paused
        attention = torch.ones_like(prompts)
        return self.model.generate(
            input_ids=prompts, attention_mask=attention, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )


class FSDPActor:
    """Shaped like AReaL's FSDPEngine: ``.model`` (FSDP2), ``.optimizer``, ``.lr_scheduler``,
    ``.config.path``, and the methods that push weights to a rollout engine."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any, config: TrainEngineConfig) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.rollout: InProcessRollout | None = None
        self.version = 0

    def connect_engine(self, engine: InProcessRollout, meta: WeightUpdateMeta) -> None:
        self.rollout = engine

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        full = {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in self.model.state_dict().items()
        }  # collective under FSDP2
        assert self.rollout is not None
        self.rollout.receive(full)

    def set_version(self, version: int) -> None:
        self.version = version

    def train_on(self, sequences: torch.Tensor) -> float:
        loss = self.model(input_ids=sequences, labels=sequences).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def step_lr_scheduler(self) -> None:
        self.lr_scheduler.step()


class Evaluator:
    """State shaped like AReaL's Evaluator (its EpochStepTimeFreqCtl): counters and clocks."""

    def __init__(self, freq_steps: int) -> None:
        self.freq_steps = freq_steps
        self.steps = 0
        self.evaluations: list[int] = []

    def evaluate(self, evaluate_fn: Any, epoch: int, epoch_step: int, global_step: int) -> None:
        self.steps += 1
        if self.steps % self.freq_steps == 0:
            evaluate_fn()
            self.evaluations.append(global_step)

    def state_dict(self) -> dict[str, Any]:
        counters = {
            "frequence_seconds": None,
            "frequency_steps": self.freq_steps,
            "start_time": 1.7e9,
            "steps": self.steps,
            "last_time": 1.7e9,
            "last_steps": 0,
            "interval_steps": None,
            "interval_seconds": None,
            "initial_value": False,
        }
        return {
            "epoch": dict(counters, frequency_steps=None),
            "step": counters,
            "time": dict(counters),
            "evaluations": self.evaluations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["step"]["steps"]
        self.evaluations = list(state["evaluations"])


class StatsLogger:
    """State shaped like AReaL's StatsLogger."""

    def __init__(self) -> None:
        self._last_commit_step = -1

    def commit(self, epoch: int, step: int, global_step: int, data: dict[str, float]) -> None:
        self._last_commit_step = max(global_step, self._last_commit_step + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"last_commit_step": self._last_commit_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_commit_step = state["last_commit_step"]


def cycle_dataloader(dataloader: StatefulDataLoader):
    """AReaL's areal.utils.data.cycle_dataloader."""
    while True:
        yield from dataloader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    args, overrides = parser.parse_known_args()
    dist.init_process_group("gloo")
    try:
        train(args, overrides)
    finally:
        gc.collect()  # free DTensors before the group goes (torch 2.13 + gloo teardown)
        dist.destroy_process_group()


def train(args: argparse.Namespace, overrides: list[str]) -> None:
    config = load_config(args.config, overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    attempt = int(os.environ.get(ATTEMPT_VARIABLE, "0"))
    torch.manual_seed(1)

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer)
    model = build_model(len(tokenizer))
    rollout = InProcessRollout(copy.deepcopy(model))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    data = torch.Generator().manual_seed(5)
    dataset = [
        {"id": i, "prompt": torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=data)} for i in range(PROMPTS)
    ]
    train_dataloader = StatefulDataLoader(
        dataset,
        batch_size=2,
        sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1),
        collate_fn=lambda items: items,
        drop_last=True,
    )
    total_train_epochs = 2
    ft_spec = FinetuneSpec(
        total_train_epochs=total_train_epochs,
        dataset_size=len(train_dataloader) * 2,
        train_batch_size=2,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    actor = FSDPActor(
        model,
        optimizer,
        warmup_cosine(optimizer, 3, ft_spec.total_train_steps),
        TrainEngineConfig(path=args.base_model),
    )
    weight_update_meta = WeightUpdateMeta(type="disk")
    actor.connect_engine(rollout, weight_update_meta)

    is_recover_run = check_if_recover(config.recover, 0)
    evaluator = Evaluator(freq_steps=3)
    saver = Saver(config.saver, ft_spec)
    recover_handler = RecoverHandler(config.recover, ft_spec)
    stats_logger = StatsLogger()
    recover_info = recover_handler.load(
        actor,
        saver,
        evaluator,
        stats_logger,
        train_dataloader,
        inference_engine=rollout,
        weight_update_meta=weight_update_meta,
    )
    if recover_info is not None:
        actor_full = {
            name: (t.full_tensor() if isinstance(t, DTensor) else t) for name, t in model.state_dict().items()
        }
        rollout_state = rollout.model.state_dict()
        (out / f"resume-rank{rank}.json").write_text(
            json.dumps(
                {
                    "attempt": attempt,
                    "check_if_recover": is_recover_run,
                    "start_step": recover_info.last_step_info.next().global_step,
                    "rollout_version": rollout.version,
                    "actor_version": actor.version,
                    "rollout_has_recovered_weights": all(
                        torch.equal(actor_full[k], rollout_state[k]) for k in actor_full
                    ),
                    "evaluator": evaluator.state_dict(),
                    "stats_logger": stats_logger.state_dict(),
                }
            )
        )

    start_step = recover_info.last_step_info.next().global_step if recover_info is not None else 0
    steps_per_epoch = len(train_dataloader)
    max_steps = total_train_epochs * steps_per_epoch
    data_generator = cycle_dataloader(train_dataloader)
    log = open(out / f"steps-rank{rank}.jsonl", "a")
    for global_step in range(start_step, max_steps):
        epoch = global_step // steps_per_epoch
        step = global_step % steps_per_epoch
        batch = next(data_generator)
        saver.maybe_wait_for_staging()

        prompts = torch.stack([item["prompt"] for item in batch])
        sequences = rollout.generate(prompts)
        loss = actor.train_on(sequences)
        actor.step_lr_scheduler()
        rollout.pause()
        actor.update_weights(weight_update_meta.with_version(global_step + 1))
        rollout.resume()
        actor.set_version(global_step + 1)
        rollout.set_version(global_step + 1)

        saver.save(actor, epoch, step, global_step, tokenizer=tokenizer, processor=processor)
        if not saver.is_async:
            dist.barrier()

        to_save = dict(default=actor)
        step_info = StepInfo(
            global_step=global_step,
            epoch=epoch,
            epoch_step=step,
            steps_per_epoch=len(train_dataloader),
        )
        recover_handler.dump(
            to_save,
            step_info,
            saver,
            evaluator,
            stats_logger,
            train_dataloader,
            tokenizer=tokenizer,
            processor=processor,
        )
        dist.barrier()
        log.write(
            json.dumps(
                {
                    "step": global_step,
                    "attempt": attempt,
                    "ids": [item["id"] for item in batch],
                    "generated": sequences.tolist(),
                    "loss": loss.hex(),
                    "components_at_dump": {
                        "evaluator": evaluator.state_dict(),
                        "stats_logger": stats_logger.state_dict(),
                    },
                }
            )
            + "\n"
        )
        log.flush()
        evaluator.evaluate(lambda: None, epoch, step, global_step)
        stats_logger.commit(epoch, step, global_step, {"loss": loss})
        if global_step == args.kill_at and attempt == 0 and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    saver.finalize()
    recover_handler.close()

    final = {
        name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone().contiguous()
        for name, t in model.state_dict().items()
    }
    for fqn, entries in optimizer.state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                name = next(n for n, p in model.named_parameters() if p is fqn)
                final[f"optim.{name}.{key}"] = (
                    value.to_local().detach().clone().contiguous()
                    if isinstance(value, DTensor)
                    else value.detach().clone()
                )
    final["lr"] = torch.tensor([group["lr"] for group in optimizer.param_groups], dtype=torch.float64)
    save_file(final, out / f"final-rank{rank}.safetensors")
    (out / f"components-rank{rank}.json").write_text(
        json.dumps(
            {
                "evaluator": evaluator.state_dict(),
                "stats_logger": stats_logger.state_dict(),
                "rollout_version": rollout.version,
            }
        )
    )


if __name__ == "__main__":
    main()
