"""A tiny GRPO-style RL problem: the policy learns to add two digits, rewarded by checking.

Prompts are ``"a+b="``; the policy samples a group of completions per prompt; the reward is
verifiable (the completion is compared with the true sum); advantages are normalized within each
group; the loss is the policy-gradient term plus a KL penalty towards a frozen reference policy,
with a coefficient that adapts towards a target KL. Everything runs on CPU in seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def make_prompts(count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` prompts ``"a+b="`` with their answers, digits 0-9."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(count)]
    return [(f"{a}+{b}=", a + b) for a, b in pairs]


def reward(completion: str, answer: int) -> float:
    """1 for the right sum, 0.2 for at least starting with a digit (shaping), else 0."""
    digits = ""
    for char in completion.strip():
        if not char.isdigit():
            break
        digits += char
    if digits and int(digits) == answer:
        return 1.0
    return 0.2 if digits else 0.0


@dataclass
class Rollout:
    """A batch of sampled completions with what the loss needs."""

    sequences: torch.Tensor  # prompt + completion token ids, [batch * group, length]
    completion_mask: torch.Tensor  # 1 on completion tokens, [batch * group, length - 1] (shifted)
    rewards: torch.Tensor  # [batch * group]
    advantages: torch.Tensor  # [batch * group]


@torch.no_grad()
def sample(policy: Any, tokenizer: Any, prompts: list[tuple[str, int]], group: int, new_tokens: int) -> Rollout:
    """Sample ``group`` completions per prompt (draws from the torch RNG: restored on resume)."""
    policy.eval()
    texts = [text for text, _ in prompts for _ in range(group)]
    answers = [answer for _, answer in prompts for _ in range(group)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    prompt_length = encoded["input_ids"].shape[1]
    sequences = policy.generate(
        **encoded,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    completions = tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=True)
    rewards = torch.tensor([reward(text, answer) for text, answer in zip(completions, answers)])
    grouped = rewards.view(-1, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1)
    mask[:, prompt_length - 1 :] = 1.0
    policy.train()
    return Rollout(sequences, mask, rewards, advantages)


def token_logprobs(model: Any, sequences: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token, [batch, length - 1]."""
    logits = model(input_ids=sequences).logits[:, :-1]
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, sequences[:, 1:, None]).squeeze(2)


def grpo_loss(policy: Any, reference: Any, rollout: Rollout, kl_coef: float) -> tuple[torch.Tensor, float]:
    """Policy-gradient loss with a KL penalty to the reference policy; returns (loss, mean KL)."""
    logprobs = token_logprobs(policy, rollout.sequences)
    with torch.no_grad():
        reference_logprobs = token_logprobs(reference, rollout.sequences)
    log_ratio = reference_logprobs - logprobs
    kl = (torch.exp(log_ratio) - log_ratio - 1) * rollout.completion_mask  # k3 estimator, >= 0
    tokens = rollout.completion_mask.sum()
    policy_term = -(rollout.advantages[:, None] * logprobs * rollout.completion_mask).sum() / tokens
    mean_kl = kl.sum() / tokens
    return policy_term + kl_coef * mean_kl, float(mean_kl.detach())


def adapt_kl(kl_coef: float, kl: float, target: float) -> float:
    """Move the KL coefficient towards keeping the measured KL near ``target``."""
    return kl_coef * (1.1 if kl > target else 1 / 1.1)
