"""Claimed samples → padded tensors → verl DataProto (CONTRACT §7 "Conversion"), against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from openjiuwen.agent_evolving.agent_rl.online.training.batch import EmptyBatch, convert_samples

from openjiuwen.agent_evolving.agent_rl.online.training.verl.data import to_data_proto
from openjiuwen.agent_evolving.agent_rl.online.training.verl.engine import micro_batch_size, shard_rows

PAD = 99


def sample(sid: str, prompt, response, logprobs=None, mask=None, score=None, task=None) -> dict:
    traj = {"prompt_ids": prompt, "response_ids": response}
    if logprobs is not None:
        traj["response_logprobs"] = logprobs
    if mask is not None:
        traj["response_mask"] = mask
    doc = {"sample_id": sid, "trajectory_id": sid, "rl_task_id": task or f"t-{sid}", "session_id": f"s-{sid}",
           "policy_version": "tiny:v2" if sid == "b" else None, "created_at": "", "trajectory": traj}
    if score is not None:
        doc["judge"] = {"score": score, "source": "terminal"}
    return doc


SAMPLES = [
    sample("a", [1, 2], [5, 6], [-0.5, -0.25], score=1.0, task="t1"),
    # prompt over 3: keep its LAST 3; response over 3: keep its FIRST 3 (mask and logprobs alike)
    sample("b", [7, 8, 9, 10], [11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0], mask=[1, 1, 0, 1], score=0.5, task="t1"),
    sample("c", [3], [4], None, task="t2"),  # no logprobs → zeros; no judge → score 0
    sample("d", [3], [], []),  # no response token → dropped
    sample("e", [3], [4, 4], [-1.0, -1.0], mask=[0, 0]),  # no trained token → dropped
]


def test_conversion_matches_hand_computed_tensors() -> None:
    b = convert_samples(SAMPLES, pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    assert b.prompts.tolist() == [[PAD, 1, 2], [8, 9, 10], [PAD, PAD, 3]]  # left-padded
    assert b.responses.tolist() == [[5, 6, PAD], [11, 12, 13], [4, PAD, PAD]]  # right-padded
    assert b.input_ids.tolist() == [[PAD, 1, 2, 5, 6, PAD], [8, 9, 10, 11, 12, 13], [PAD, PAD, 3, 4, PAD, PAD]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 1]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert b.old_log_probs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    # the score on the LAST position whose mask is 1 (b: position 1, its position 2 is masked out)
    assert b.token_level_scores.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    assert b.meta == {"num_samples": 3, "pad_token_id": PAD, "dropped_samples": 2, "prompt_truncated_samples": 1,
                      "response_truncated_samples": 1, "max_prompt_length": 3, "max_response_length": 3,
                      "constrained_samples": 0}
    assert b.dropped_sample_ids == ["d", "e"]
    assert b.uid == ["a", "b", "c"]
    grpo = convert_samples(SAMPLES, pad_token_id=PAD, max_prompt_length=3, max_response_length=3,
                           advantage_estimator="grpo")
    assert grpo.uid == ["t1", "t1", "t2"]


def test_overlong_prompts_are_dropped_under_filtering_and_an_empty_batch_is_an_error() -> None:
    b = convert_samples(SAMPLES, pad_token_id=None, max_prompt_length=3, max_response_length=3,
                        filter_overlong_prompts=True)
    assert b.sample_ids == ["a", "c"] and b.dropped_sample_ids == ["b", "d", "e"]
    assert b.prompts.tolist() == [[1, 2], [0, 3]]  # P = the longest kept prompt; no pad id: 0
    with pytest.raises(EmptyBatch):
        convert_samples(SAMPLES[3:], pad_token_id=PAD, max_prompt_length=3, max_response_length=3)


def test_data_proto_carries_the_captured_logprobs_as_old_and_rollout_log_probs() -> None:
    b = convert_samples(SAMPLES, pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    data = to_data_proto(b)
    t = data.batch
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                "token_level_scores"):
        assert torch.equal(t[key], getattr(b, key)), key
    assert torch.equal(t["old_log_probs"], b.old_log_probs) and torch.equal(t["rollout_log_probs"], b.old_log_probs)
    t["old_log_probs"][0, 0] = 5.0  # two tensors: verl's bypass mode overwrites one with the other
    assert t["rollout_log_probs"][0, 0].item() == -0.5
    nt = data.non_tensor_batch
    assert list(nt["uid"]) == ["a", "b", "c"] and list(nt["sample_id"]) == ["a", "b", "c"]
    assert list(nt["rl_task_id"]) == ["t1", "t1", "t2"] and list(nt["session_id"]) == ["s-a", "s-b", "s-c"]
    assert list(nt["policy_version"]) == ["base", "tiny:v2", "base"]
    assert nt["judge_score"].tolist() == [1.0, 0.5, 0.0]
    assert data.meta_info["dropped_samples"] == 2 and data.meta_info["response_truncated_samples"] == 1


def test_ranks_split_a_mini_batch_and_padding_rows_carry_no_advantage() -> None:
    b = convert_samples(SAMPLES, pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    data = to_data_proto(b)
    data.batch["advantages"] = torch.ones_like(b.response_mask)
    assert shard_rows(data, 0, 1) is data
    first, second = shard_rows(data, 0, 2), shard_rows(data, 1, 2)
    assert first.batch["input_ids"].tolist() == data.batch["input_ids"][:2].tolist()
    assert second.batch["input_ids"].tolist() == [data.batch["input_ids"][2].tolist()] * 2  # c, then its filler
    assert second.batch["response_mask"].tolist() == [[1, 0, 0], [1, 0, 0]]  # one token: verl needs one per row
    assert second.batch["advantages"].tolist() == [[1, 1, 1], [0, 0, 0]]  # ... that pushes nothing


@pytest.mark.parametrize(("rows", "configured", "micro"), [(32, 16, 16), (3, 2, 1), (6, 4, 3), (5, None, 5),
                                                           (1, 2, 1)])
def test_micro_batches_divide_the_rows(rows: int, configured: int | None, micro: int) -> None:
    assert micro_batch_size(rows, configured) == micro
