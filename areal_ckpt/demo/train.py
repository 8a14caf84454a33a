"""The demo's training process: GRPO-style RL of a tiny causal LM on digit addition, on CPU.

It follows docs/recovery.md: one RecoverHandler.load() before training, resume from
``info.last_step_info.next()``, a DistributedSampler with a seed plus ``set_epoch`` and a
dataloader with its own generator, ``save`` and ``dump`` after every step. The reference policy
is a frozen engine (dumped once, then hard-linked); the adaptive KL coefficient travels in
``client_state``. Everything is built locally; nothing is downloaded.
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
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import areal_ckpt as ac
from areal_ckpt.demo.report import checkpoint_table, plot, read_metrics, replay_check, retention_note
from areal_ckpt.demo.rl import adapt_kl, grpo_loss, make_prompts, sample
from areal_ckpt.demo.tiny import build_model, build_tokenizer, warmup_cosine
from areal_ckpt.tools.launch import ATTEMPT_VARIABLE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo.train", description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="SIGKILL this process after global step K (default: demo.kill_at_step); only in "
        "the first attempt under `areal-ckpt launch`, so the relaunched job finishes (run on "
        "its own, without the launcher, it is never killed)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. saver.freq_steps=5")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13

    cfg = ac.load_config(args.config, args.overrides)
    demo = (yaml.safe_load(Path(args.config).read_text()) or {}).get("demo", {})
    kill_at_step = args.kill_at_step if args.kill_at_step is not None else demo.get("kill_at_step", -1)
    if os.environ.get(ATTEMPT_VARIABLE) != "0":  # not the launcher's first attempt (or no launcher)
        kill_at_step = -1
    seed = demo["seed"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    policy = build_model(len(tokenizer), attention_dropout=0.1)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    prompts = make_prompts(demo["dataset_size"], seed)
    dataset: Any = prompts  # a list is a map-style dataset
    sampler: DistributedSampler[tuple[str, int]] = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=seed
    )
    loader = StatefulDataLoader(
        prompts,
        batch_size=demo["batch_size"],
        sampler=sampler,
        collate_fn=list,
        generator=torch.Generator().manual_seed(seed),
    )
    ft_spec = ac.FinetuneSpec(
        total_train_epochs=demo["epochs"], dataset_size=len(prompts), train_batch_size=demo["batch_size"]
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=demo["lr"])
    scheduler = warmup_cosine(optimizer, demo["warmup_steps"], ft_spec.total_train_steps)
    actor = ac.TorchEngine(policy, optimizer=optimizer, lr_scheduler=scheduler)
    engines = {"actor": actor, "ref": ac.TorchEngine(reference)}
    saver = ac.Saver(cfg.saver, ft_spec)
    recover = ac.RecoverHandler(cfg.recover, ft_spec)
    reports = Path(cfg.saver.fileroot) / "reports" / cfg.saver.experiment_name / cfg.saver.trial_name
    reports.mkdir(parents=True, exist_ok=True)

    info = recover.load(engines, saver=saver, dataloader=loader)
    if info is None:
        start = ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=ft_spec.steps_per_epoch)
        kl_coef = demo["kl_coef"]
        print(
            f"fresh start: {sum(p.numel() for p in policy.parameters()):,} parameters, "
            f"{ft_spec.total_train_steps} RL steps",
            flush=True,
        )
    else:
        start = info.last_step_info.next()
        kl_coef = info.client_state["kl_coef"]
        print(
            f"resuming from global step {start.global_step} (last dump after step "
            f"{info.last_step_info.global_step}; kl_coef {kl_coef:.4f})",
            flush=True,
        )

    metrics = open(reports / "metrics.jsonl", "a")
    global_step = start.global_step
    for epoch in range(start.epoch, ft_spec.total_train_epochs):
        sampler.set_epoch(epoch)
        epoch_step = start.epoch_step if epoch == start.epoch else 0
        bar = tqdm(total=ft_spec.steps_per_epoch, initial=epoch_step, desc=f"epoch {epoch}", disable=None)
        for batch in loader:
            rollout = sample(policy, tokenizer, batch, demo["group_size"], demo["new_tokens"])
            loss, kl = grpo_loss(policy, reference, rollout, kl_coef)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            kl_coef = adapt_kl(kl_coef, kl, demo["kl_target"])
            step = ac.StepInfo(
                epoch=epoch, epoch_step=epoch_step, global_step=global_step, steps_per_epoch=ft_spec.steps_per_epoch
            )
            last = global_step == ft_spec.total_train_steps - 1
            exported = saver.save(actor, epoch, epoch_step, global_step, name="actor", tokenizer=tokenizer, force=last)
            export_seconds = saver.last_metrics["time/saving"] if exported else None
            dumped = recover.dump(
                engines,
                step,
                saver=saver,
                dataloader=loader,
                tokenizer=tokenizer,
                client_state={"kl_coef": kl_coef},
                force=last,
            )
            dump_seconds = recover.last_metrics["time/saving"] if dumped else None
            record = {
                "pid": os.getpid(),
                "global_step": global_step,
                "loss": float(loss.item()).hex(),
                "reward": rollout.rewards.mean().item(),
                "kl": kl,
                "kl_coef": kl_coef,
                "export_seconds": export_seconds,
                "recover_seconds": dump_seconds,
            }
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            events = ("  export" if exported else "") + ("  recover-dump" if dumped else "")
            bar.set_postfix(reward=f"{record['reward']:.2f}", kl=f"{kl:.4f}", loss=f"{loss.item():.3f}")
            bar.update()
            if bar.disable:
                print(
                    f"epoch {epoch} step {epoch_step:2d} global {global_step:2d} loss {loss.item():.6f} "
                    f"reward {record['reward']:.3f} kl {kl:.5f}{events}",
                    flush=True,
                )
            if global_step == kill_at_step:
                bar.close()
                print(f"simulating a crash: SIGKILL at global step {global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            epoch_step += 1
            global_step += 1
        bar.close()
    metrics.close()
    saver.finalize()
    recover.close()
    summarize(saver, reports)
    return 0


def summarize(saver: ac.Saver, reports: Path) -> None:
    """Print the checkpoints, the replay check and the plot; load the newest export and generate."""
    records = read_metrics(reports / "metrics.jsonl")
    print(f"\ncheckpoints of this trial, {saver.trial_root} (newest first):")
    print("\n".join(checkpoint_table(saver.trial_root, records)))
    print(retention_note(saver.trial_root, records, saver.config.keep_last))
    print(f"\nreplay check: {replay_check(records)}")
    plot(records, reports / "report.png")
    print(f"plot of reward, KL and save events: {reports / 'report.png'}")
    exports = [p for p in saver.export_root("actor").iterdir() if p.name.startswith("epoch")]
    newest = max(exports, key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
    print(
        f"\nload the newest export like any HF model:\n"
        f"    model = AutoModelForCausalLM.from_pretrained('{newest}')\n"
        f"    tokenizer = AutoTokenizer.from_pretrained('{newest}')"
    )
    # Any: transformers' annotation of generate changes between releases (5.23 rejects this call)
    model: Any = AutoModelForCausalLM.from_pretrained(newest, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(newest, local_files_only=True)
    for prompt in ("3+4=", "8+9="):
        encoded = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**encoded, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print(f"    generate({prompt!r}) -> {tokenizer.decode(output[0], skip_special_tokens=True)!r}")
    print(
        "    (a model of a few thousand parameters after 24 steps: its sums are not meant to be right; the point is\n"
        "    that the export loads and generates like any HF model)"
    )
    print(f"\nlook at the trial from a shell:\n    TRIAL={saver.trial_root}\n    areal-ckpt list $TRIAL")


if __name__ == "__main__":
    sys.exit(main())
