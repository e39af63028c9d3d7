"""Ratio guard on the local trainer's PPO work (issue 38 item 4): a Training Run's π_old, report and steps per sample
against a plain forward pass over the same batch, in the same run and thread (tests/support/trainer_cost.py,
tests/support/cost_ratio.py), on the tiny model with the SmolLM2 recipe's settings.

Issue 29's sampling work once recomputed π_old for every row with a full-prompt forward pass, for the sampling report
alone, and doubled a SmolLM2 Training Run unnoticed (66 s against 33-38 s). That trainer (c617b54's
`local_worker._PPOUpdate`) measures a median ratio of 1.83 here (rounds 1.59-2.04); the trainer that forwards only the
rows that need π_old and the report's sample, with the shared prompt prefix kept per weight state, 1.03 (0.95-1.13);
the same without the kept prefix 1.30. The PPO work costs about one plain forward pass because the recipe's
`detach_prompt` runs the long shared prompt once per mini-batch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("verl")

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from tests.support.cost_ratio import RatioGuard  # noqa: E402
from tests.support.trainer_cost import CurrentUpdate, forward_block, recipe_batch, training_block  # noqa: E402

pytestmark = pytest.mark.alone  # a CPU ratio: other tests on the same cores would move it

# Median ratio measured on the 2-core development machine (2026-12-05, load average 10-11 from other work), twice
# each: 1.03 and 1.03 now, 1.83 and 1.83 with c617b54's trainer; at load average 3, 0.96 and 1.78. The margin keeps the limit (1.34) below every round
# of the slow path.
GUARD = RatioGuard("PPO work per sample / plain forward per sample", bound=1.03, margin=0.3)
ROUNDS = 5


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's CPU time is then all of the work
    yield
    torch.set_num_threads(threads)


def test_the_trainer_costs_a_bounded_multiple_of_a_forward_pass(tmp_path, one_thread) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "model", seed=0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))
    batch = recipe_batch(base.config.vocab_size)
    train, forward = training_block(CurrentUpdate, model, batch), forward_block(model, batch)
    train(), forward()  # warm: first calls allocate and pick kernels
    ratios = []
    for i in range(ROUNDS):  # alternate which block goes first (cost_ratio.interleaved_ratios, without asyncio)
        if i % 2:
            ref = forward()
            cost = train()
        else:
            cost = train()
            ref = forward()
        ratios.append(cost / ref)
    failure = GUARD.verdict(ratios)
    assert failure is None, failure
