"""`make demo`: train a tiny causal LM on digit arithmetic on CPU and export it with the Saver.

Everything is built locally (tokenizer trained on a few strings, model from a config); nothing
is downloaded. The job ends by loading the newest export with ``from_pretrained`` and
generating from it, exactly as a user would.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import torch
import yaml
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

import areal_ckpt as ac
from areal_ckpt.demo.tiny import build_model, build_tokenizer, warmup_cosine


def make_problems(count: int, seed: int) -> list[str]:
    """``count`` addition problems with their answers, e.g. ``"12+7=19"``."""
    rng = random.Random(seed)
    return [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(50), rng.randrange(50)) for _ in range(count))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_ckpt.demo", description=__doc__)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. saver.freq_steps=5")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    cfg = ac.load_config(args.config, args.overrides)
    demo = (yaml.safe_load(Path(args.config).read_text()) or {}).get("demo", {})
    torch.manual_seed(demo["seed"])
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    problems = make_problems(demo["dataset_size"], demo["seed"])
    encoded = tokenizer(problems, padding="max_length", max_length=12, return_tensors="pt")
    dataset = list(zip(encoded["input_ids"], encoded["attention_mask"]))
    loader = StatefulDataLoader(
        dataset, batch_size=demo["batch_size"], shuffle=True, generator=torch.Generator().manual_seed(demo["seed"])
    )
    ft_spec = ac.FinetuneSpec(
        total_train_epochs=demo["epochs"], dataset_size=len(dataset), train_batch_size=demo["batch_size"]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=demo["lr"])
    scheduler = warmup_cosine(optimizer, demo["warmup_steps"], ft_spec.total_train_steps)
    engine = ac.TorchEngine(model, optimizer=optimizer, lr_scheduler=scheduler)
    saver = ac.Saver(cfg.saver, ft_spec)

    print(f"training {sum(p.numel() for p in model.parameters()):,} parameters for {ft_spec.total_train_steps} steps")
    global_step = 0
    for epoch in range(ft_spec.total_train_epochs):
        for epoch_step, (input_ids, attention_mask) in enumerate(loader):
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            last = global_step == ft_spec.total_train_steps - 1
            path = saver.save(engine, epoch, epoch_step, global_step, tokenizer=tokenizer, force=last)
            note = f"  -> export {path} ({saver.last_metrics['time/saving']:.2f} s)" if path else ""
            print(f"epoch {epoch} step {epoch_step:2d} global {global_step:2d} loss {loss.item():.3f}{note}")
            global_step += 1
    saver.finalize()

    newest = sorted(
        (p for p in saver.export_root().iterdir() if not p.name.startswith(".")),
        key=lambda p: int(p.name.rsplit("globalstep", 1)[1]),
    )[-1]
    print(f"\nloading the newest export with from_pretrained: {newest}")
    loaded = AutoModelForCausalLM.from_pretrained(newest, local_files_only=True)
    loaded_tokenizer = AutoTokenizer.from_pretrained(newest, local_files_only=True)
    prompt = loaded_tokenizer("12+7=", return_tensors="pt")
    output = loaded.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=loaded_tokenizer.pad_token_id)
    print(f"generate('12+7=') -> {loaded_tokenizer.decode(output[0], skip_special_tokens=True)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
