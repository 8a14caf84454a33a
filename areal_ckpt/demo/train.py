"""The demo's training process: a tiny causal LM learns digit addition on CPU.

It follows docs/recovery.md: one RecoverHandler.load() before training, resume from
``info.last_step_info.next()``, a DistributedSampler with a seed plus ``set_epoch`` and a
dataloader with its own generator, ``dump`` and ``save`` after every step. Everything is built
locally (tokenizer trained on a few strings, model from a config); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model, build_tokenizer, warmup_cosine


def make_problems(count: int, seed: int) -> list[str]:
    """``count`` addition problems with their answers, e.g. ``"12+7=19"``."""
    rng = random.Random(seed)
    return [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(count))]


def newest_export(saver: ac.Saver) -> Path:
    """The committed export with the highest global step."""
    exports = [p for p in saver.export_root().iterdir() if p.name.startswith("epoch")]
    return max(exports, key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo.train", description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--kill-at-step", type=int, default=-1, help="SIGKILL this process after global step K")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. saver.freq_steps=5")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13

    cfg = ac.load_config(args.config, args.overrides)
    demo = (yaml.safe_load(Path(args.config).read_text()) or {}).get("demo", {})
    random.seed(demo["seed"])
    np.random.seed(demo["seed"])
    torch.manual_seed(demo["seed"])
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), attention_dropout=0.1)
    problems = make_problems(demo["dataset_size"], demo["seed"])
    encoded = tokenizer(problems, padding="max_length", max_length=12, return_tensors="pt")
    dataset = list(zip(encoded["input_ids"], encoded["attention_mask"]))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=demo["seed"])
    loader = StatefulDataLoader(
        dataset, batch_size=demo["batch_size"], sampler=sampler, generator=torch.Generator().manual_seed(demo["seed"])
    )
    ft_spec = ac.FinetuneSpec(
        total_train_epochs=demo["epochs"], dataset_size=len(dataset), train_batch_size=demo["batch_size"]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo["lr"])
    scheduler = warmup_cosine(optimizer, demo["warmup_steps"], ft_spec.total_train_steps)
    engine = ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler)
    saver = ac.Saver(cfg.saver, ft_spec)
    recover = ac.RecoverHandler(cfg.recover, ft_spec)

    info = recover.load(engine, saver=saver, dataloader=loader)
    if info is None:
        start = ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=ft_spec.steps_per_epoch)
        print(f"fresh start: {sum(p.numel() for p in model.parameters()):,} parameters, {ft_spec.total_train_steps} steps")
    else:
        start = info.last_step_info.next()
        print(f"resuming from global step {start.global_step} (last dump after step {info.last_step_info.global_step})")
    global_step = start.global_step
    for epoch in range(start.epoch, ft_spec.total_train_epochs):
        sampler.set_epoch(epoch)
        epoch_step = start.epoch_step if epoch == start.epoch else 0
        for input_ids, attention_mask in loader:
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step = ac.StepInfo(epoch=epoch, epoch_step=epoch_step, global_step=global_step,
                               steps_per_epoch=ft_spec.steps_per_epoch)
            last = global_step == ft_spec.total_train_steps - 1
            exported = saver.save(engine, epoch, epoch_step, global_step, tokenizer=tokenizer, force=last)
            dumped = recover.dump(engine, step, saver=saver, dataloader=loader, force=last)
            notes = ("  export" if exported else "") + ("  recover-dump" if dumped else "")
            print(f"epoch {epoch} step {epoch_step:2d} global {global_step:2d} loss {loss.item():.4f}{notes}", flush=True)
            if global_step == args.kill_at_step:
                print(f"simulating a crash: SIGKILL at global step {global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            epoch_step += 1
            global_step += 1
    saver.finalize()

    newest = newest_export(saver)
    print(f"\nloading the newest export with from_pretrained: {newest}")
    loaded = AutoModelForCausalLM.from_pretrained(newest, local_files_only=True)
    loaded_tokenizer = AutoTokenizer.from_pretrained(newest, local_files_only=True)
    prompt = loaded_tokenizer("12+7=", return_tensors="pt")
    output = loaded.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=loaded_tokenizer.pad_token_id)
    print(f"generate('12+7=') -> {loaded_tokenizer.decode(output[0], skip_special_tokens=True)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
