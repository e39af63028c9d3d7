"""Claimed samples → the padded tensors a PPO actor trains on (CONTRACT §7 "Conversion", "Chunking").

The captured token ids are used as they are (never re-tokenized), the captured logprobs become the behaviour
("old") log-probabilities, the scalar score sits on the last valid response token, and each row carries the
temperature its sample was drawn at (and whether its sampling truncated the distribution: common/sampling.py) and
whether its sampling was constrained (`corrected`: common/constraints.py; such a row is always trained with truncated
importance weights against its behaviour logprobs, training/ppo_math.py `behaviour_correction`). A greedy row's
behaviour probability is 1 for every chosen token (logprob 0; vLLM reports the temperature-1 logprobs, which are not
what the token was drawn with) and it is trained at temperature 1.
The local backend trains on these tensors; the verl backend wraps the same tensors in a DataProto. torch is
imported by the trainer processes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.policy_names import BASE_POLICY
from ...common import constraints
from ...common.sampling import Sampling
from .backends.common import sample_score


class EmptyBatch(ValueError):
    """Every sample was dropped (no valid response token, or an overlong prompt under filtering)."""


@dataclass
class ConvertedBatch:
    prompts: torch.Tensor  # [B, P] left-padded
    responses: torch.Tensor  # [B, R] right-padded
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R] float, 1 on trained response tokens
    old_log_probs: torch.Tensor  # [B, R] captured behaviour logprobs, 0 on pads
    token_level_scores: torch.Tensor  # [B, R] the score on the last valid response token
    temperatures: torch.Tensor  # [B] float32, the temperature each sample is trained at (drawn at; 1 if greedy)
    truncated: torch.Tensor  # [B] bool, its sampling cut the distribution (top_p / top_k / min_p)
    corrected: torch.Tensor  # [B] bool, its sampling was constrained: always trained with truncated IS weights
    greedy: torch.Tensor  # [B] bool, drawn greedily: its behaviour logprobs are 0, not the policy's (pi_old.py)
    uid: list[str]
    sample_ids: list[str]
    rl_task_ids: list[str | None]
    session_ids: list[str | None]
    policy_versions: list[str]
    judge_scores: list[float]
    created_at: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    dropped_sample_ids: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.prompts.shape[0])


def _uid(sample: dict[str, Any], advantage_estimator: str) -> str:
    if advantage_estimator == "grpo":
        if sample.get("group_uid"):  # the choices of one `n` > 1 request: one prompt, one group
            return str(sample["group_uid"])
        if sample.get("rl_task_id"):
            return str(sample["rl_task_id"])
        if sample.get("source") == "rail" and sample.get("session_id"):
            return str(sample["session_id"])
    return str(sample["sample_id"])


def convert_samples(
    samples: Sequence[dict[str, Any]],
    *,
    pad_token_id: int | None,
    max_prompt_length: int,
    max_response_length: int,
    filter_overlong_prompts: bool = False,
    advantage_estimator: str = "reinforce_plus_plus",
) -> ConvertedBatch:
    pad = 0 if pad_token_id is None else int(pad_token_id)
    rows: list[tuple[dict[str, Any], list[int], list[int], list[float], list[int], Sampling, bool]] = []
    dropped: list[str] = []
    prompt_truncated = response_truncated = 0
    for sample in samples:
        traj = sample.get("trajectory") or {}
        sampling = Sampling.of_record(sample.get("sampling"))
        prompt = [int(t) for t in traj.get("prompt_ids") or []]
        response = [int(t) for t in traj.get("response_ids") or []]
        logprobs = [float(x) for x in traj.get("response_logprobs") or []]
        mask = traj.get("response_mask")
        mask = [1] * len(response) if mask is None else [1 if m else 0 for m in mask][: len(response)]
        mask += [1] * (len(response) - len(mask))
        if len(prompt) > max_prompt_length:
            if filter_overlong_prompts:
                dropped.append(str(sample["sample_id"]))
                continue
            prompt = prompt[-max_prompt_length:]
            prompt_truncated += 1
        if len(response) > max_response_length:
            response, mask = response[:max_response_length], mask[:max_response_length]
            response_truncated += 1
        logprobs = (logprobs + [0.0] * len(response))[: len(response)]
        if sampling.greedy:
            logprobs = [0.0] * len(response)  # μ is a point mass on each chosen token
        if not response or not any(mask) or not prompt:
            dropped.append(str(sample["sample_id"]))
            continue
        rows.append((sample, prompt, response, logprobs, mask, sampling,
                     bool(constraints.kinds_of(sample.get("sampling")))))
    if not rows:
        raise EmptyBatch("every sample of the batch was dropped")

    batch = len(rows)
    p_len = max(1, max(len(r[1]) for r in rows))
    r_len = max(1, max(len(r[2]) for r in rows))
    prompts = torch.full((batch, p_len), pad, dtype=torch.long)
    prompt_attn = torch.zeros((batch, p_len), dtype=torch.long)
    responses = torch.full((batch, r_len), pad, dtype=torch.long)
    response_attn = torch.zeros((batch, r_len), dtype=torch.long)
    response_mask = torch.zeros((batch, r_len), dtype=torch.float32)
    old_log_probs = torch.zeros((batch, r_len), dtype=torch.float32)
    scores = torch.zeros((batch, r_len), dtype=torch.float32)
    for i, (sample, prompt, response, logprobs, mask, _, _) in enumerate(rows):
        prompts[i, p_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_attn[i, p_len - len(prompt):] = 1
        responses[i, : len(response)] = torch.tensor(response, dtype=torch.long)
        response_attn[i, : len(response)] = 1
        response_mask[i, : len(response)] = torch.tensor(mask, dtype=torch.float32)
        old_log_probs[i, : len(response)] = torch.tensor(logprobs, dtype=torch.float32)
        last = max(j for j, m in enumerate(mask) if m)
        scores[i, last] = sample_score(sample)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    old_log_probs = old_log_probs * (response_mask > 0)
    picked = [r[0] for r in rows]
    return ConvertedBatch(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        old_log_probs=old_log_probs,
        token_level_scores=scores,
        temperatures=torch.tensor([r[5].train_temperature for r in rows], dtype=torch.float32),
        truncated=torch.tensor([r[5].truncates for r in rows], dtype=torch.bool),
        corrected=torch.tensor([r[6] for r in rows], dtype=torch.bool),
        greedy=torch.tensor([r[5].greedy for r in rows], dtype=torch.bool),
        uid=[_uid(s, advantage_estimator) for s in picked],
        sample_ids=[str(s["sample_id"]) for s in picked],
        rl_task_ids=[s.get("rl_task_id") for s in picked],
        session_ids=[s.get("session_id") for s in picked],
        policy_versions=[str(s.get("policy_version") or BASE_POLICY) for s in picked],
        judge_scores=[sample_score(s) for s in picked],
        created_at=[str(s.get("created_at") or "") for s in picked],
        meta={
            "num_samples": batch,
            "pad_token_id": pad,
            "dropped_samples": len(dropped),
            "prompt_truncated_samples": prompt_truncated,
            "response_truncated_samples": response_truncated,
            "max_prompt_length": max_prompt_length,
            "max_response_length": max_response_length,
            "constrained_samples": sum(1 for r in rows if r[6]),
        },
        dropped_sample_ids=dropped,
    )


def chunk_rows(
    count: int, per_step: int, *, uids: Sequence[str] | None = None, created_at: Sequence[str] | None = None
) -> list[list[int]]:
    """Row indices of each PPO step: one step when `per_step` is 0 or ≥ count; else consecutive slices of
    `per_step` in claim order (9 rows, 4 → 4, 4, 1). With `uids` (grpo), rows are first ordered by (uid,
    created_at) and a slice boundary moves forward to the next group boundary, so a group is never split."""
    order = list(range(count))
    if uids is not None:
        stamps = created_at or [""] * count
        order.sort(key=lambda i: (uids[i], stamps[i]))
    if per_step <= 0 or per_step >= count:
        return [order]
    chunks: list[list[int]] = []
    start = 0
    while start < count:
        end = min(start + per_step, count)
        if uids is not None:
            while end < count and uids[order[end]] == uids[order[end - 1]]:
                end += 1
        chunks.append(order[start:end])
        start = end
    return chunks
