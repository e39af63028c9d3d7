"""Which rows the local trainer computes π_old for (issue 38 item 4, training/pi_old.py): the rows whose loss reads it
and cannot take their captured logprobs for it, plus the sampling report's seeded sample. A row may reuse its captured
logprobs only when the run's parent drew it at its training temperature, untruncated and unconstrained; every other
row still gets the forward pass, and a sample that refutes the premise turns reuse off."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training import pi_old  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.batch import convert_samples  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings, apply_tree  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_update import PPOUpdate  # noqa: E402

PARENT = "tiny:v3"
NO_KL = {"use_kl_in_reward": False, "learning_rate": 0.0}  # the KL reference pass would forward every row


def doc(i: int, *, version: str = PARENT, sampling: dict | None = None, logprobs: list[float] | None = None) -> dict:
    response = [20 + i, 30 + i, 40 + i]
    return {"sample_id": f"s{i}", "rl_task_id": f"t{i}", "policy_version": version, "judge": {"score": float(i % 2)},
            "sampling": sampling if sampling is not None else {"temperature": 0.8},
            "trajectory": {"prompt_ids": [5, 6, 7, 8 + i], "response_ids": response,
                           "response_logprobs": logprobs or [-1.0] * len(response)}}


# Row 0 is the only one whose captured logprobs are π_old by construction.
KINDS = [
    ("drawn by the parent", {}),
    ("drawn by another version", {"version": "tiny:v2"}),
    ("truncated (top_p)", {"sampling": {"temperature": 0.8, "top_p": 0.9}}),
    ("constrained (grammar)", {"sampling": {"temperature": 0.8, "constraints": {"json_schema": {"bytes": 1}}}}),
    ("greedy, stored before constraints were recorded", {"sampling": {"temperature": 0}}),
]


def convert(docs: list[dict]):
    return convert_samples(docs, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def test_only_parent_drawn_plain_rows_may_reuse_their_captured_logprobs() -> None:
    batch = convert([doc(i, **kw) for i, (_, kw) in enumerate(KINDS)])
    assert pi_old.reusable_rows(batch, PARENT).tolist() == [True, False, False, False, False]
    assert pi_old.reusable_rows(batch, "base").tolist() == [False] * 5


def test_the_plan_forwards_needed_rows_that_cannot_reuse_and_the_report_sample() -> None:
    batch = convert([doc(i, **kw) for i, (_, kw) in enumerate(KINDS)])
    tis = pi_old.plan(batch, PPOSettings(tis_cap=2.0, sampling_report_rows=0), PARENT)
    assert tis.needed.all() and tis.forwarded().tolist() == [False, True, True, True, True]
    bypass = pi_old.plan(batch, PPOSettings(sampling_report_rows=0), PARENT)
    assert bypass.forwarded().tolist() == [False, False, False, True, False]  # the constrained row alone
    sampled = pi_old.plan(batch, PPOSettings(sampling_report_rows=2, seed=3), PARENT)
    assert int(sampled.report.sum()) == 2 and sampled.report.equal(pi_old.report_sample(5, 2, 3))
    assert pi_old.report_sample(5, 9, 0).all() and not pi_old.report_sample(5, 0, 0).any()


def test_sampling_report_rows_is_read_from_the_local_section() -> None:
    assert PPOSettings().sampling_report_rows == 16
    assert apply_tree(PPOSettings(), {"local": {"sampling_report_rows": 4}}).sampling_report_rows == 4


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))


def true_logprobs(policy, docs: list[dict]) -> torch.Tensor:
    """The parent weights' logprobs of every row: what a processed-logprobs vLLM would have captured."""
    probe = PPOUpdate(policy, convert(docs), PPOSettings(sampling_report_rows=0))
    return probe.forward_rows(range(len(docs)))


def counted_forwards(update: PPOUpdate) -> list[int]:
    seen: list[int] = []
    real = update.forward_rows

    def spy(rows, **kw):
        rows = list(rows)
        seen.extend(rows)
        return real(rows, **kw)

    update.forward_rows = spy  # type: ignore[method-assign]
    return seen


def test_under_tis_reused_rows_skip_the_forward_and_the_others_get_it(policy) -> None:
    docs = [doc(i, **kw) for i, (_, kw) in enumerate(KINDS)] + [doc(5)]
    exact = true_logprobs(policy, docs)
    for i in (0, 5):  # the parent-drawn rows carry their exact logprobs, as captured
        docs[i]["trajectory"]["response_logprobs"] = exact[i].tolist()
    batch = convert(docs)
    update = PPOUpdate(policy, batch, PPOSettings(tis_cap=2.0, sampling_report_rows=1, seed=0, **NO_KL))
    forwarded = counted_forwards(update)
    update.fix_log_probs(PARENT)
    sample = pi_old.report_sample(6, 1, 0)
    expected = sorted({1, 2, 3, 4} | set(torch.nonzero(sample).view(-1).tolist()))
    assert sorted(forwarded) == expected  # a reusable row is forwarded only when the report samples it
    assert torch.allclose(update._pi_old, exact, atol=1e-6)  # every row's π_old is right, reused or not
    reused = 2 - int(sample[0]) - int(sample[5])
    assert update.sampling["pi_old_reused_samples"] == reused
    assert update.sampling["recomputed_samples"] == len(expected)


def test_a_sample_that_refutes_reuse_turns_it_off(policy) -> None:
    """Captured logprobs 0.5 nats off the parent's (a vLLM in raw_logprobs mode at temperature 0.8): the sampled
    reusable row shows it, and every reusable row is forwarded."""
    docs = [doc(i) for i in range(4)]
    exact = true_logprobs(policy, docs)
    for i, d in enumerate(docs):
        d["trajectory"]["response_logprobs"] = (exact[i] + 0.5).tolist()
    update = PPOUpdate(policy, convert(docs), PPOSettings(tis_cap=2.0, sampling_report_rows=1, **NO_KL))
    forwarded = counted_forwards(update)
    update.fix_log_probs(PARENT)
    assert sorted(forwarded) == [0, 1, 2, 3]
    assert update.sampling["pi_old_reused_samples"] == 0 and update.sampling["recomputed_samples"] == 4
    assert torch.allclose(update._pi_old, exact, atol=1e-6)
    assert update.sampling["untruncated_mismatch_max"] == pytest.approx(0.5, abs=1e-4)


def test_in_bypass_mode_only_the_report_sample_is_recomputed(policy) -> None:
    docs = [doc(i) for i in range(6)]
    update = PPOUpdate(policy, convert(docs), PPOSettings(sampling_report_rows=2, **NO_KL))
    forwarded = counted_forwards(update)
    update.fix_log_probs(PARENT)
    assert len(forwarded) == 2 and update._pi_old is None  # no row's loss reads π_old
    assert update.sampling["recomputed_samples"] == 2 and update.sampling["correction"] == "ppo_clip"
    assert update.sampling["tokens"] == 6  # the sample's trained tokens
