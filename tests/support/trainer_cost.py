"""What the trainer's ratio guard measures (tests/integration/test_trainer_cost_guard.py, issue 38 item 4): a Training
Run's PPO work on the tiny model, per sample, against a plain forward pass over the same batch, in this thread.

The batch has the calculator family's shape (docs/learning.md): every prompt starts with the same long system prompt
and examples, then a few tokens of its own, then a short response; the settings are the SmolLM2 recipe (lr 5e-4,
1 epoch, mini-batch 16, micro-batch 4, KL and entropy off, `detach_prompt`). One torch thread, so that this thread's
CPU time is all the work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from openjiuwen.agent_evolving.agent_rl.online.training.batch import ConvertedBatch, convert_samples
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings
from tests.support.cost_ratio import thread_cpu

RECIPE = PPOSettings(learning_rate=5e-4, ppo_epochs=1, ppo_mini_batch_size=16, ppo_micro_batch_size=4,
                     use_kl_in_reward=False, kl_coef=0.0, entropy_coeff=0.0, detach_prompt=True, num_threads=1,
                     max_prompt_length=512, max_response_length=64)
SAMPLES = 32
SHARED, OWN, RESPONSE = 192, 12, 16  # prompt tokens every row shares, prompt tokens of its own, response tokens


def recipe_batch(vocab: int, seed: int = 0) -> ConvertedBatch:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (SHARED,), generator=gen).tolist()
    docs = []
    for i in range(SAMPLES):
        own = torch.randint(3, vocab, (OWN - i % 3,), generator=gen).tolist()  # prompts of unequal length
        response = torch.randint(3, vocab, (RESPONSE - i % 5,), generator=gen).tolist()
        docs.append({"sample_id": f"g{i}", "rl_task_id": f"t{i}", "policy_version": "base",
                     "judge": {"score": float(i % 2)}, "sampling": {"temperature": 1.0},
                     "trajectory": {"prompt_ids": shared + own, "response_ids": response,
                                    "response_logprobs": [-2.0] * len(response)}})
    return convert_samples(docs, pad_token_id=0, max_prompt_length=RECIPE.max_prompt_length,
                           max_response_length=RECIPE.max_response_length)


def training_block(make_update: Callable[[Any, ConvertedBatch, PPOSettings], Any], model: Any,
                   batch: ConvertedBatch) -> Callable[[], float]:
    """One Training Run's PPO work (π_old and the report, every step) on `batch`: CPU seconds per sample.
    `make_update(model, batch, settings)` returns an object with `run()` (the trainer under guard)."""
    def block() -> float:
        started = thread_cpu()
        make_update(model, batch, RECIPE).run()
        return (thread_cpu() - started) / len(batch)
    return block


def forward_block(model: Any, batch: ConvertedBatch) -> Callable[[], float]:
    """The reference: a plain forward pass without autograd over the same rows, in the recipe's micro-batches,
    logits of the response positions only: CPU seconds per sample."""
    micro = RECIPE.ppo_micro_batch_size
    keep = batch.responses.shape[1] + 1

    def block() -> float:
        started = thread_cpu()
        with torch.no_grad():
            for start in range(0, len(batch), micro):
                rows = slice(start, start + micro)
                model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                      position_ids=batch.position_ids[rows], use_cache=False, logits_to_keep=keep)
        return (thread_cpu() - started) / len(batch)
    return block


class CurrentUpdate:
    """This tree's trainer: ppo_update.PPOUpdate as local_worker.train drives it."""

    def __init__(self, model: Any, batch: ConvertedBatch, settings: PPOSettings) -> None:
        from openjiuwen.agent_evolving.agent_rl.online.training.ppo_update import PPOUpdate

        self._update = PPOUpdate(model, batch, settings)

    def run(self) -> None:
        self._update.fix_log_probs("base")
        for step, rows in enumerate(self._update.slices(), start=1):
            self._update.step(step, rows)
