"""The `constrained_samples` section of the RL Service config (issue 35; docs/training.md "Constrained samples"):
for each kind of constraint a sample can carry (common/constraints.py), whether it is trained with the correction
for its behaviour probabilities (`correct`) or kept out of training (`exclude`).

A `correct` sample is trained off-policy: its captured processed logprobs are the behaviour policy μ (vLLM applies
grammars, penalties, bias, bans and min-tokens before it reports them), the trainers compute π_old with the parent
weights and weight each token by min(π_old / μ, cap) (training/ppo_math.py). An `exclude` sample is stored, rewarded,
counted and shown, and published `excluded` (its `exclusion` says why): no Training Run ever claims it. The decision
is taken when the sample is published, with the setting in force then.
"""

from __future__ import annotations

from typing import Literal

from ...common.validation import ConfigModel

Policy = Literal["correct", "exclude"]


class ConstrainedSamplesConfig(ConfigModel):
    """One key per constraint kind (every grammar kind shares `grammar`); the defaults are
    common/constraints.POLICY_DEFAULTS, with their reasons in docs/training.md."""

    grammar: Policy = "correct"
    greedy: Policy = "exclude"
    penalties: Policy = "correct"
    logit_bias: Policy = "correct"
    allowed_tokens: Policy = "correct"
    banned_tokens: Policy = "correct"
    min_tokens: Policy = "correct"
    ignore_eos: Policy = "correct"
    thinking_budget: Policy = "correct"
    logits_processors: Policy = "exclude"
    watermarking: Policy = "exclude"
    echo: Policy = "exclude"
    continue_final_message: Policy = "exclude"
    no_generation_prompt: Policy = "exclude"
    chat_template: Policy = "exclude"
    beam_search: Literal["exclude"] = "exclude"  # no sampling distribution to correct against

    def policy(self) -> dict[str, str]:
        """`constrained_samples` as common/constraints.excluded_kinds reads it."""
        return self.model_dump()
