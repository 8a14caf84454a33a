"""Tiny, fully local model and tokenizer: nothing is downloaded."""

from __future__ import annotations

import math
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]

_CORPUS = [
    "12+7=19",
    "3+4=7",
    "40+2=42",
    "the answer is 5",
    "what is 8+9? 17",
    "0 1 2 3 4 5 6 7 8 9 + - = ? the answer is",
]


def build_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer trained on a few arithmetic strings (deterministic, offline)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def build_model(vocab_size: int, **overrides: Any) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM built from a small config (hidden 64, 2 layers unless overridden)."""
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    settings.update(overrides)
    return Qwen2ForCausalLM(Qwen2Config(**settings))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for ``warmup`` steps, then cosine decay to zero at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
