"""A converted batch (`training/batch.py`) as the `DataProto` verl's trainer builds after a rollout (CONTRACT §7
"Conversion"): the same tensors the local backend trains on, under verl's key names. Training side only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from verl import DataProto

from ..batch import ConvertedBatch


def _objects(values: Sequence[object]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)  # element-wise: a list of equal-length lists must stay 1-D
    out[:] = list(values)
    return out


def to_data_proto(batch: ConvertedBatch) -> DataProto:
    """Captured logprobs go in twice: `rollout_log_probs` (what verl's bypass mode and TIS read as the behaviour
    policy) and `old_log_probs` (replaced by bypass mode with the same values, or by π_old under `tis_cap`).
    `temperature` is per row: verl's FSDP engine divides each row's logits by its own temperature when the key is a
    tensor of the batch (a plain number would apply one temperature to every row)."""
    return DataProto.from_dict(
        tensors={
            "prompts": batch.prompts,
            "responses": batch.responses,
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "response_mask": batch.response_mask,
            "old_log_probs": batch.old_log_probs.clone(),
            "rollout_log_probs": batch.old_log_probs.clone(),
            "token_level_scores": batch.token_level_scores,
            "temperature": batch.temperatures,
        },
        non_tensors={
            "uid": _objects(batch.uid),
            "sample_id": _objects(batch.sample_ids),
            "rl_task_id": _objects(batch.rl_task_ids),
            "session_id": _objects(batch.session_ids),
            "policy_version": _objects(batch.policy_versions),
            "judge_score": np.asarray(batch.judge_scores, dtype=np.float32),
        },
        meta_info=dict(batch.meta),
    )
