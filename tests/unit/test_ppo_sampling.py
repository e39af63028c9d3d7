"""Training at each sample's sampling (issue 29 item 3): the converted batch carries every row's temperature, the
trainers' logprobs divide each row's logits by its own temperature (one batch may mix them), and the sampling report
measures captured against recomputed logprobs with the share of clipped ratios."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.batch import convert_samples  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_math import (  # noqa: E402
    response_log_probs, sampling_report,
)
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings  # noqa: E402


def sample(i: int, sampling: dict | None, response: list[int]) -> dict:
    doc = {"sample_id": f"s{i}", "rl_task_id": f"t{i}", "judge": {"score": 1.0},
           "trajectory": {"prompt_ids": [5, 6, 7 + i], "response_ids": response,
                          "response_logprobs": [-1.0] * len(response)}}
    if sampling is not None:
        doc["sampling"] = sampling
    return doc


def test_the_batch_carries_each_samples_temperature_and_truncation() -> None:
    samples = [sample(0, {"temperature": 0.7, "top_p": 0.9}, [8, 9]), sample(1, None, [10]),
               sample(2, {"temperature": 1.3, "top_k": 0}, [11, 12, 13]), sample(3, {"min_p": 0.1}, [14])]
    batch = convert_samples(samples, pad_token_id=0, max_prompt_length=8, max_response_length=8)
    assert batch.temperatures.tolist() == pytest.approx([0.7, 1.0, 1.3, 1.0])
    assert batch.truncated.tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="sampling record"):
        convert_samples([sample(0, {"temperature": -1}, [8])], pad_token_id=0, max_prompt_length=8,
                        max_response_length=8)


def test_constrained_rows_are_marked_greedy_rows_trained_at_one_and_choices_grouped() -> None:
    """Issue 35: a row whose `sampling.constraints` names a kind is `corrected`; a greedy row's behaviour logprob is
    0 (μ is a point mass) and it is trained at temperature 1; the choices of one `n` > 1 request share a GRPO uid."""
    greedy = sample(0, {"temperature": 0, "constraints": {"greedy": {}}}, [8, 9])
    schema = sample(1, {"temperature": 0.7, "constraints": {"json_schema": {"digest": "ab", "bytes": 9}}}, [10])
    old = sample(2, {"temperature": 0.7}, [11])  # stored before issue 35: no `constraints`
    choices = [dict(sample(3 + i, None, [12 + i]), rl_task_id="t9", group_uid="t9:c1") for i in range(2)]
    batch = convert_samples([greedy, schema, old, *choices], pad_token_id=0, max_prompt_length=8,
                            max_response_length=8, advantage_estimator="grpo")
    assert batch.corrected.tolist() == [True, True, False, False, False]
    assert batch.temperatures.tolist() == pytest.approx([1.0, 0.7, 0.7, 1.0, 1.0])
    assert batch.old_log_probs[0].tolist() == [0.0, 0.0] and batch.old_log_probs[1, 0] == -1.0
    assert batch.uid == ["t0", "t1", "t2", "t9:c1", "t9:c1"] and batch.meta["constrained_samples"] == 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_each_row_is_computed_at_its_own_temperature(model) -> None:
    torch.manual_seed(3)
    b, p, r = 3, 10, 5
    ids = torch.randint(3, 300, (b, p + r))
    mask = torch.ones(b, p + r, dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp = ids[:, p:]
    temps = torch.tensor([0.7, 1.3, 1.0])
    mixed = response_log_probs(model, ids, mask, pos, resp, temps, with_entropy=True)
    logits = model(input_ids=ids).logits[:, p - 1 : -1].float()
    for row, t in enumerate(temps.tolist()):
        alone = F.log_softmax(logits[row] / t, -1)
        expected = alone.gather(-1, resp[row].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(mixed.log_probs[row], expected, atol=1e-5), t
        assert torch.allclose(mixed.entropy[row], -(alone.exp() * alone).sum(-1), atol=1e-5)
    at_one = response_log_probs(model, ids, mask, pos, resp, torch.ones(b))
    assert torch.allclose(at_one.log_probs[2], mixed.log_probs[2])
    assert not torch.allclose(at_one.log_probs[0], mixed.log_probs[0], atol=1e-3)


def test_the_report_measures_the_gap_and_the_clipped_ratios() -> None:
    recomputed = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    # Row 0 untruncated (exact), row 1 truncated (captured higher by -log(kept mass)), row 2 from another version.
    captured = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0], [-1.5, -0.4, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    truncated = torch.tensor([False, True, False])
    temps = torch.tensor([0.7, 0.7, 1.3])
    bypass = sampling_report(captured=captured, recomputed=recomputed, response_mask=mask, temperatures=temps,
                             truncated=truncated, settings=PPOSettings())
    gaps = [0, 0, 0, 0.5, 1.0, 1.0, 0.1, 0]
    assert bypass["tokens"] == 8 and bypass["temperatures"] == {"0.7": 2, "1.3": 1}
    assert bypass["truncated_samples"] == 1 and bypass["correction"] == "ppo_clip"
    assert bypass["logprob_mismatch_mean"] == pytest.approx(sum(gaps) / 8, abs=1e-6)
    assert bypass["logprob_mismatch_max"] == pytest.approx(1.0)
    assert bypass["untruncated_mismatch_max"] == pytest.approx(1.0)  # the lagged row's
    # Ratios exp(recomputed - captured): 0.61 and 0.37 (row 1), 2.72 and 0.90 (row 2); PPO's window is [0.8, 1.28].
    assert bypass["ratio_clipped_share"] == pytest.approx(3 / 8)
    tis = sampling_report(captured=captured, recomputed=recomputed, response_mask=mask, temperatures=temps,
                          truncated=truncated, settings=PPOSettings(tis_cap=2.0))
    assert tis["correction"] == "tis" and tis["ratio_clipped_share"] == pytest.approx(1 / 8)


def test_constrained_rows_are_decoupled_with_truncated_weights_and_the_others_stay_in_bypass() -> None:
    """Issue 35 (`ppo_math.behaviour_correction`): without `tis_cap` only the constrained rows use π_old as the old
    logprobs, weighted min(π_old / μ, 2); with `tis_cap` every row is decoupled at that cap; with neither nothing."""
    from openjiuwen.agent_evolving.agent_rl.online.training.ppo_math import CONSTRAINED_TIS_CAP, behaviour_correction

    mu = torch.tensor([[-0.2, -2.0], [-2.0, -0.5]])
    pi_old = torch.tensor([[-1.2, -0.5], [-1.0, -0.6]])
    old, weights = behaviour_correction(mu, pi_old, torch.tensor([True, False]), PPOSettings())
    assert torch.equal(old, torch.tensor([[-1.2, -0.5], [-2.0, -0.5]]))
    expected = torch.tensor([[torch.exp(torch.tensor(-1.0)).item(), CONSTRAINED_TIS_CAP], [1.0, 1.0]])
    assert torch.allclose(weights, expected) and CONSTRAINED_TIS_CAP == 2.0
    old, weights = behaviour_correction(mu, pi_old, torch.tensor([True, False]), PPOSettings(tis_cap=1.5))
    assert torch.equal(old, pi_old) and torch.allclose(weights[1], torch.tensor([1.5, torch.exp(torch.tensor(-0.1))]))
    old, weights = behaviour_correction(mu, None, torch.tensor([False, False]), PPOSettings())
    assert old is mu and weights is None


def test_the_local_trainer_trains_constrained_rows_against_pi_old(model) -> None:
    """The local trainer's PPO step takes its old logprobs and weights from `behaviour_correction`: flagging a row
    as constrained changes the loss it reports to exactly the rule's, and the sampling report says so."""
    from openjiuwen.agent_evolving.agent_rl.online.training import ppo_math
    from openjiuwen.agent_evolving.agent_rl.online.training.ppo_update import PPOUpdate
    from peft import LoraConfig, get_peft_model

    settings = PPOSettings(use_kl_in_reward=False, entropy_coeff=0.0, ppo_mini_batch_size=4, ppo_micro_batch_size=4,
                           learning_rate=0.0)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))

    def batch(constrained: bool):
        docs = [sample(i, {"temperature": 1.0, "constraints": {"json_schema": {"bytes": 1}} if constrained and i == 0
                           else {}}, [20 + i, 30 + i, 40 + i]) for i in range(2)]
        # The constrained row has the negative advantage: in bypass mode its ratio π/μ (μ far above the policy, as a
        # grammar makes it) is clipped at 0.8 and it gets no gradient; decoupled, it is weighted min(π_old/μ, 2).
        docs[0]["judge"], docs[1]["judge"] = {"score": 0.0}, {"score": 1.0}
        return convert_samples(docs, pad_token_id=0, max_prompt_length=8, max_response_length=8)

    losses = []
    for constrained in (False, True):
        b = batch(constrained)
        update = PPOUpdate(peft, b, settings)
        update.fix_log_probs("base")
        assert update.sampling["constrained_samples"] == int(constrained)
        assert update.sampling["correction"] == ("ppo_clip+constrained_tis" if constrained else "ppo_clip")
        step = update.step(1, [0, 1])
        pi_old = update.forward_rows(range(len(b)))  # lr 0: the weights did not move
        old, weights = ppo_math.behaviour_correction(b.old_log_probs, pi_old, b.corrected, settings)
        rewards, _ = ppo_math.token_level_rewards(b.token_level_scores, b.response_mask,
                                                  behaviour_log_probs=b.old_log_probs, ref_log_probs=None,
                                                  settings=settings)
        adv = ppo_math.advantages(rewards, b.response_mask, b.uid, settings)
        expected, _ = ppo_math.policy_loss(old_log_probs=old, log_probs=pi_old, adv=adv, response_mask=b.response_mask,
                                           entropy=None, is_weights=weights, actor=ppo_math.actor_config(settings),
                                           settings=settings)
        assert step["pg_loss"] == pytest.approx(float(expected), abs=1e-5)
        losses.append(step["pg_loss"])
    assert losses[0] != pytest.approx(losses[1], abs=1e-4)  # the flag changed the update
