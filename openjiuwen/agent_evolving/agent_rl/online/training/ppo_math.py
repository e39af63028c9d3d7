"""The PPO objective of CONTRACT §7 on converted batches, with verl's own algorithm functions.

Advantages (REINFORCE++ or GRPO), the KL penalty and the clipped policy loss come from
`verl.trainer.ppo.core_algos`, so the local and the distributed trainers share the same math. Loaded only inside
trainer processes (torch and verl are heavy).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    get_policy_loss_fn,
    kl_penalty,
)
from verl.workers.config import ActorConfig

from .ppo_settings import PPOSettings


@dataclass
class TokenStats:
    log_probs: torch.Tensor  # [B, R]
    entropy: torch.Tensor | None  # [B, R]


def response_log_probs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    with_entropy: bool = False,
    detach_prompt: bool = False,
    prefix: SharedPrefix | None = None,
) -> TokenStats:
    """Log-probabilities (and entropies) of the response tokens under `model` at each row's temperature
    (`temperatures` [B]): log softmax(logits / T) over the whole vocabulary, the policy each sample was drawn from
    before any truncation (verl's engine divides the same way). The logits at position t predict token t + 1, so the
    response part starts one position before the first response token.

    `detach_prompt`: run the prompt (all but its last token) without autograd and keep its keys/values as a cache,
    then run the last prompt token and the response with autograd on top of it. The log-probabilities are the same
    (the forward pass is unchanged); the gradient no longer flows into the prompt tokens' keys/values through the
    LoRA. For agent turns whose prompt (system prompt, examples, history) is ten times the response, this cuts the
    backward pass and the stored activations to the response tokens (docs/learning.md). `prefix`: the shared prompt
    prefix's keys/values kept across the calls of one weight state (`SharedPrefix`)."""
    resp_len = responses.shape[1]
    split = input_ids.shape[1] - resp_len - 1  # tokens run without autograd
    if detach_prompt and split > 0:
        cache, mask_head = _prompt_cache(model, input_ids, attention_mask, position_ids, split, prefix)
        out = model(input_ids=input_ids[:, split:], attention_mask=torch.cat([mask_head, attention_mask[:, split:]], 1),
                    position_ids=position_ids[:, split:], past_key_values=cache, use_cache=True)
        logits = out.logits[:, :-1, :].float()
    else:
        # Only the last R + 1 positions' logits are needed: the vocabulary projection of every prompt token (49k
        # columns for SmolLM2) costs time and memory for nothing. Models without `logits_to_keep` return them all.
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    logits_to_keep=resp_len + 1)
        logits = out.logits[:, -(resp_len + 1) : -1, :].float()
    logits = logits / temperatures.to(logits.device, torch.float32).view(-1, 1, 1)
    log_softmax = F.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None
    return TokenStats(log_probs, entropy)


class SharedPrefix:
    """The keys/values of the prompt prefix that rows share (an agent's system prompt and examples), for one row,
    kept across the micro-batches that run with the same weights: a mini-batch's micro-batches before its optimizer
    step, a whole pass without autograd. Its owner makes a new one whenever the weights change (a stale one would
    feed the old weights' keys/values to the new ones). The first micro-batch computes it; each later one takes the
    longest leading part its own shared prefix agrees with (keys/values of a causal model's first k tokens do not
    depend on the tokens after them)."""

    def __init__(self) -> None:
        self._tokens: torch.Tensor | None = None  # [L]
        self._cache: Any = None  # one row's cache of those L tokens, never extended in place

    def agreeing(self, tokens: torch.Tensor) -> int:
        """How many leading tokens of `tokens` [n] the kept prefix holds."""
        if self._tokens is None:
            return 0
        n = min(len(tokens), len(self._tokens))
        differ = torch.nonzero(tokens[:n] != self._tokens[:n])
        return n if differ.numel() == 0 else int(differ[0, 0])

    def keep(self, tokens: torch.Tensor, cache: Any) -> None:
        self._tokens, self._cache = tokens.clone(), copy.deepcopy(cache)

    def cache_for(self, length: int) -> Any:
        """A copy of the kept cache cut to its first `length` tokens, for the caller to extend."""
        cache = copy.deepcopy(self._cache)
        cache.crop(length)
        return cache


@torch.no_grad()
def _prompt_cache(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, split: int,
    prefix: SharedPrefix | None = None,
) -> tuple[Any, torch.Tensor]:
    """Keys/values of the first `split` columns (left-padded prompts, all but their last token), and the attention
    mask the cache's key positions carry. The leading tokens every row shares (an agent's system prompt and
    examples) are run once, for one row, and the cache is repeated for the batch; then each row's remaining prompt
    tokens are appended, right-aligned at column `split` as in the input, with the row's leftover columns masked.
    Position ids stay the input's (they count a row's real tokens from 0), so the values are the same as from one
    pass over the whole prompt."""
    rows = input_ids.shape[0]
    real = attention_mask[:, :split].sum(1)  # real prompt tokens before the split, per row
    starts = split - real
    shortest = int(real.min())
    shared = 0
    if shortest > 1:
        idx = starts[:, None] + torch.arange(shortest)[None, :]
        window = input_ids.gather(1, idx)  # each row's first `shortest` real tokens
        same = (window == window[:1]).all(0)
        shared = shortest if bool(same.all()) else int(torch.nonzero(~same)[0, 0])
        shared = min(shared, shortest - 1)  # keep at least one token per row for the second pass
    if shared < 2:
        head = model(input_ids=input_ids[:, :split], attention_mask=attention_mask[:, :split],
                     position_ids=position_ids[:, :split], use_cache=True, logits_to_keep=1)
        return head.past_key_values, attention_mask[:, :split]
    first = int(starts[0])
    kept = 0 if prefix is None else prefix.agreeing(input_ids[0, first : first + shared])
    if kept >= 2:
        shared = kept
        cache = prefix.cache_for(shared)
    else:
        head = model(input_ids=input_ids[:1, first : first + shared],
                     attention_mask=attention_mask[:1, first : first + shared],
                     position_ids=position_ids[:1, first : first + shared], use_cache=True, logits_to_keep=1)
        cache = head.past_key_values
        if prefix is not None:
            prefix.keep(input_ids[0, first : first + shared], cache)
    cache.batch_repeat_interleave(rows)
    width = int(real.max()) - shared  # columns after the shared part, up to the split
    cols = torch.arange(split - width, split)
    keep = (cols[None, :] >= (starts + shared)[:, None]).to(attention_mask.dtype)
    mask = torch.cat([torch.ones(rows, shared, dtype=attention_mask.dtype), keep], 1)
    model(input_ids=input_ids[:, split - width : split], attention_mask=mask,
          position_ids=position_ids[:, split - width : split], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, mask


def algo_config(settings: PPOSettings) -> AlgoConfig:
    return AlgoConfig(gamma=settings.gamma, lam=settings.lam, adv_estimator=settings.advantage_estimator)


def actor_config(settings: PPOSettings) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=settings.ppo_mini_batch_size,
        ppo_micro_batch_size_per_gpu=settings.ppo_micro_batch_size,
        clip_ratio=settings.clip_ratio,
        clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high,
        loss_agg_mode=settings.loss_agg_mode,
        entropy_coeff=settings.entropy_coeff,
    )


def token_level_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    behaviour_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
    settings: PPOSettings,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores − kl_coef · KL(policy ‖ frozen base) per token; also returns the per-token KL (None without it)."""
    if ref_log_probs is None or not settings.use_kl_in_reward or settings.kl_coef == 0:
        return scores * response_mask, None
    kl = kl_penalty(behaviour_log_probs, ref_log_probs, settings.kl_penalty) * response_mask
    return (scores - settings.kl_coef * kl) * response_mask, kl


def advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, uids: list[str], settings: PPOSettings
) -> torch.Tensor:
    if settings.advantage_estimator == "grpo":
        adv, _ = compute_grpo_outcome_advantage(
            token_level_rewards=rewards, response_mask=response_mask, index=np.array(uids, dtype=object),
            config=algo_config(settings),
        )
        return adv
    if int(response_mask.sum().item()) < 2:
        # Whitening needs two valid tokens; a single token has no spread to normalize.
        return torch.zeros_like(rewards)
    adv, _ = compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=response_mask, config=algo_config(settings)
    )
    return adv


def policy_loss(
    *,
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    actor: ActorConfig,
    settings: PPOSettings,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's vanilla PPO-clip loss (with the truncated importance weights when given), minus the entropy bonus."""
    loss_fn = get_policy_loss_fn("vanilla")
    pg_loss, metrics = loss_fn(
        old_log_prob=old_log_probs, log_prob=log_probs, advantages=adv, response_mask=response_mask.bool(),
        loss_agg_mode=settings.loss_agg_mode, config=actor, rollout_is_weights=is_weights,
    )
    loss = pg_loss
    out = {
        "pg_loss": float(pg_loss.detach()),
        "clip_fraction": float(metrics.get("actor/pg_clipfrac", 0.0)),
        "ppo_kl": float(metrics.get("actor/ppo_kl", 0.0)),
    }
    if entropy is not None and settings.entropy_coeff:
        entropy_term = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=settings.loss_agg_mode)
        loss = loss - settings.entropy_coeff * entropy_term
        out["entropy"] = float(entropy_term.detach())
    return loss, out


def truncated_is_weights(pi_old: torch.Tensor, behaviour: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log π_old − behaviour), cap), detached (CONTRACT §7 `tis_cap`)."""
    return torch.clamp(torch.exp(torch.clamp(pi_old - behaviour, max=20.0)), max=cap).detach()


# The cap of the truncated importance weights of constrained rows when the run has no `tis_cap` (docs/training.md
# "Constrained samples"): verl's default `rollout_is_threshold`.
CONSTRAINED_TIS_CAP = 2.0


def behaviour_correction(
    behaviour: torch.Tensor, pi_old: torch.Tensor | None, corrected: torch.Tensor, settings: PPOSettings,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the PPO "old" log-probabilities, the truncated importance weights or None) of a slice of rows.

    With `tis_cap` every row is decoupled: old = π_old (parent weights), weights min(π_old / μ, tis_cap) against the
    captured behaviour logprobs μ. Without it, rows whose sampling was constrained (`corrected` [B], issue 35: a
    grammar, penalties, a bias … make μ another distribution than the policy's) are decoupled the same way with cap
    `CONSTRAINED_TIS_CAP`, and the other rows keep bypass mode (old = μ, weight 1: PPO's ratio π / μ is the
    correction). `pi_old` is needed whenever a row is decoupled."""
    if not settings.tis_cap and not bool(corrected.any()):
        return behaviour, None
    assert pi_old is not None, "decoupled rows need π_old"
    if settings.tis_cap:
        return pi_old, truncated_is_weights(pi_old, behaviour, settings.tis_cap)
    rows = corrected.view(-1, 1)
    old = torch.where(rows, pi_old, behaviour)
    weights = torch.where(rows, truncated_is_weights(pi_old, behaviour, CONSTRAINED_TIS_CAP), torch.ones_like(pi_old))
    return old, weights


def sampling_report(
    *,
    captured: torch.Tensor,
    recomputed: torch.Tensor,
    response_mask: torch.Tensor,
    temperatures: torch.Tensor,
    truncated: torch.Tensor,
    settings: PPOSettings,
    corrected: torch.Tensor | None = None,
    measured: torch.Tensor | None = None,
) -> dict[str, Any]:
    """How far the captured (behaviour) logprobs are from the ones the trainer computes with the parent weights
    before the first update, over the trained tokens (`metrics.sampling` of the run record).

    With vLLM's `processed_logprobs` a captured logprob is the sampling distribution's own: equal to the trainer's
    at the sample's temperature, or higher by −log(kept mass) where truncation cut the distribution. A gap on
    untruncated rows means another policy version drew the sample (policy lag) or vLLM returned raw logprobs.
    `ratio_clipped_share`: the tokens whose importance ratio exp(recomputed − captured) the run's correction clips,
    above `tis_cap` with TIS, else outside PPO's clip range (bypass mode: the first update's ratio).
    `constrained_samples`: the rows trained with the constrained correction (`behaviour_correction`); they are left
    out of `untruncated_mismatch_max`, whose gap they have by design.
    `measured` [B] bool: the rows `recomputed` holds (the local trainer's sample, pi_old.py; None: every row). The
    gaps, `tokens` and `ratio_clipped_share` are over them (`recomputed_samples`); the counts over the batch."""
    measured = torch.ones_like(truncated) if measured is None else measured
    mask = (response_mask > 0) & measured.view(-1, 1)
    gap = (captured - recomputed).abs()[mask]
    corrected = torch.zeros_like(truncated) if corrected is None else corrected
    ratio = torch.exp(torch.clamp(recomputed - captured, max=20.0))
    if settings.tis_cap:
        clipped = ratio > settings.tis_cap
    else:
        clipped = torch.where(corrected.view(-1, 1), ratio > CONSTRAINED_TIS_CAP,
                              (ratio < 1.0 - settings.clip_ratio_low) | (ratio > 1.0 + settings.clip_ratio_high))
    clipped = clipped[mask]
    # Constrained rows differ by design (a grammar's mask, a penalty …): the lag signal is the unconstrained ones.
    untruncated = mask & ~truncated.view(-1, 1) & ~corrected.view(-1, 1)
    untruncated_gap = (captured - recomputed).abs()[untruncated]
    temps: dict[str, int] = {}
    for t in temperatures.tolist():
        key = f"{t:g}"
        temps[key] = temps.get(key, 0) + 1
    tokens = int(mask.sum().item())
    constrained = int(corrected.sum().item())
    correction = "tis" if settings.tis_cap else "ppo_clip+constrained_tis" if constrained else "ppo_clip"
    return {
        "tokens": tokens,
        "temperatures": temps,
        "truncated_samples": int(truncated.sum().item()),
        "logprob_mismatch_mean": float(gap.mean().item()) if tokens else 0.0,
        "logprob_mismatch_max": float(gap.max().item()) if tokens else 0.0,
        "untruncated_mismatch_max": float(untruncated_gap.max().item()) if untruncated_gap.numel() else None,
        "ratio_clipped_share": float(clipped.float().mean().item()) if tokens else 0.0,
        "correction": correction,
        "constrained_samples": constrained,
        "recomputed_samples": int(measured.sum().item()),
    }


COUNTER_KEYS = ("dropped_samples", "prompt_truncated_samples", "response_truncated_samples")
SUMMARY_KEYS = ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm", "tokens_per_second", "entropy")


def step_record(
    totals: dict[str, float],
    *,
    step: int,
    samples: int,
    response_mask: torch.Tensor,
    kl: torch.Tensor | None,
    scores: torch.Tensor,
    epochs: int,
    elapsed_s: float,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """One PPO step's metrics as both backends report them (`on_progress`, the run record, the artifact)."""
    tokens = int(response_mask.sum().item())
    return {
        **totals,
        "step": step,
        "samples": samples,
        "tokens": tokens,
        "kl": float((kl.sum() / response_mask.sum()).item()) if kl is not None else totals.get("ppo_kl", 0.0),
        "reward_mean": float(scores.sum(-1).mean().item()),
        "tokens_per_second": tokens * epochs / elapsed_s if elapsed_s > 0 else 0.0,
        "seconds": elapsed_s,
        **{k: meta[k] for k in COUNTER_KEYS},
    }


def run_record(steps: list[dict[str, Any]], meta: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """The run's metrics: every step, their means, the conversion counters and the sampling report."""
    summary = {k: sum(m.get(k, 0.0) for m in steps) / len(steps) for k in SUMMARY_KEYS} if steps else {}
    return {"steps": len(steps), "step_metrics": steps, "summary": summary, **{k: meta[k] for k in COUNTER_KEYS},
            "sampling": sampling}

