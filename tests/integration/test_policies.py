"""Per-version evaluation `GET /v1/rl/policies` from incremental Redis aggregates (issue 9)."""

from __future__ import annotations

import math
import statistics

import pytest

from openjiuwen.agent_evolving.agent_rl.online.capture.request import normalize_request
from openjiuwen.agent_evolving.agent_rl.online.capture.response import validate_response
from openjiuwen.agent_evolving.agent_rl.online.capture.sample import build_sample
from openjiuwen.agent_evolving.agent_rl.online.version_report import quantile_ms, reward_summary, t95
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.policy_stats import contribution
from openjiuwen.agent_evolving.agent_rl.online.tasks.task_records import Task
from openjiuwen.agent_evolving.agent_rl.online.training.backends.scripted import ScriptedBackend
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from tests.conftest import load_fixture
from tests.integration.test_training_runs import publish
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import MODEL_ID, capture, make_config, running_app, start_task
from tests.support.runs import wait_for_run

REQUEST, RESPONSE = load_fixture("chat_request.json"), load_fixture("chat_response.json")
TOKENS = len(RESPONSE["choices"][0]["token_ids"])
V1 = f"{MODEL_ID}:v1"


@pytest.fixture
async def service(redis, redis_url, tmp_path):
    async with FakeGateway(model_id=MODEL_ID) as gw:
        config = make_config(redis_url, tmp_path, aigw_endpoint=gw.url, trainer_backend="scripted",
                             min_samples_for_training=2, max_samples_per_run=2, lora_activation_timeout=3.0,
                             training_tmp_root=str(tmp_path / "train-tmp"))
        backend = ScriptedBackend(LoraRepository(config.lora_repository_path, model_id=MODEL_ID))
        async with running_app(config, backend=backend) as (app, client):
            yield app, client


async def rewarded_task(client, n: int, policy: str, reward: float, captures: int = 1) -> None:
    model = MODEL_ID if policy == "base" else policy
    request = dict(REQUEST, model=model)
    response = dict(RESPONSE, model=model)
    assert (await start_task(client, f"s{n}", f"t{n}", policy=policy, model=model)).status_code == 201
    for k in range(captures):
        _, after = await capture(client, f"t{n}", f"c{n}-{k}", request, response)
        assert after is not None and after.status_code == 204
    assert (await client.post(f"/v1/rl/tasks/t{n}/stop")).status_code == 200
    answer = await client.post(f"/v1/rl/tasks/t{n}/reward", json={"reward": reward})
    assert answer.json() == {"sample_count": captures}


async def test_versions_rewards_and_comparison(service, redis):
    app, client = service
    assert (await client.get("/v1/rl/policies")).json() == {"items": [], "comparison": None}
    base_rewards = [0.2, 0.4, 0.3]
    for i, r in enumerate(base_rewards):
        await rewarded_task(client, i, "base", r, captures=2 if i == 0 else 1)
    await start_task(client, "s-idle", "t-idle")  # a Task without samples still counts
    # A training run on two of them publishes v1 with base as its parent.
    run = (await client.post("/v1/rl/training/runs")).json()
    assert (await wait_for_run(app.state.deps.runner, run["training_run_id"])).lora_name == V1
    v1_rewards = [0.9, 0.7]
    for i, r in enumerate(v1_rewards, start=10):
        await rewarded_task(client, i, V1, r)
    body = (await client.get("/v1/rl/policies")).json()
    base, v1 = body["items"]
    assert set(body) == {"items", "comparison"}
    assert set(base) == {"policy_version", "lora_name", "parent_version", "tasks", "samples", "reward",
                         "reward_sources", "judge_agreement", "tokens_per_completion", "completion_latency_ms",
                         "evaluation"}
    assert set(base["reward"]) == {"n", "mean", "ci95"} and set(base["completion_latency_ms"]) == {"mean", "p50", "p95"}
    assert set(body["comparison"]) == {"latest", "parent", "reward_delta", "ci95"}
    assert (base["policy_version"], base["lora_name"], base["parent_version"]) == ("base", None, None)
    assert (v1["policy_version"], v1["lora_name"], v1["parent_version"]) == (V1, V1, "base")
    assert (base["tasks"], base["samples"], v1["tasks"], v1["samples"]) == (4, 4, 2, 2)
    # A terminal reward is one observation per Task, however many completions share it.
    mean, sd = statistics.mean(base_rewards), statistics.stdev(base_rewards)
    assert base["reward"]["n"] == 3 and math.isclose(base["reward"]["mean"], mean)
    half = 4.303 * sd / math.sqrt(3)
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(base["reward"]["ci95"], [mean - half, mean + half]))
    assert base["reward_sources"] == {"terminal": 4} and base["judge_agreement"] is None
    assert base["tokens_per_completion"] == TOKENS
    latency = base["completion_latency_ms"]
    assert latency["mean"] >= 0 and latency["p50"] is not None and latency["p95"] >= latency["p50"]
    comparison = body["comparison"]
    assert (comparison["latest"], comparison["parent"]) == (V1, "base")
    assert math.isclose(comparison["reward_delta"], statistics.mean(v1_rewards) - mean)
    half = t95(1) * math.sqrt(statistics.variance(v1_rewards) / 2 + statistics.variance(base_rewards) / 3)
    lo, hi = comparison["ci95"]
    assert math.isclose(lo, comparison["reward_delta"] - half) and math.isclose(hi, comparison["reward_delta"] + half)
    # The aggregates are one hash per version: nothing grows per sample.
    assert await redis.smembers(keys.POLICY_VERSIONS) == {b"base", V1.encode()}


def judged_sample(n: int, votes: list, score: float):
    task = Task(f"t{n}", f"s{n}", MODEL_ID, "base", "delayed_feedback", "active", "2026-01-01T00:00:00+00:00")
    sample = build_sample(task, capture_id=f"j{n}", agent_turn_id="u1", request=normalize_request(REQUEST),
                          response=RESPONSE, validated=validate_response(RESPONSE, policy_model=MODEL_ID))
    sample.meta["judge"] = {"score": score, "source": "judge", "tag": "feedback", "votes": votes}
    return sample


async def test_judge_agreement_and_rollback(service, redis):
    app, client = service
    store = app.state.deps.samples
    await store.publisher.insert_if_absent([judged_sample(1, [8, 6, "fail"], 0.7), judged_sample(2, [9, 9], 0.9),
                                  judged_sample(3, [5], 0.5)])
    await publish(app.state.deps, 1, score=0.8)  # a terminal sample outside a reward: no reward observation
    item = (await client.get("/v1/rl/policies")).json()["items"][0]
    assert item["reward_sources"] == {"judge": 3, "terminal": 1}
    assert (item["samples"], item["reward"]["n"], item["reward"]["mean"]) == (4, 3, pytest.approx(0.7))
    assert item["judge_agreement"] == pytest.approx(1 - (0.2 + 0.0) / 2)  # single-vote samples do not count
    assert item["completion_latency_ms"] is None  # built outside a capture: no reservation time
    # A rolled-back publication takes its contribution away in the same EXEC that deletes the samples.
    assert await store.deletion.delete_pending(["j1", "j2"]) == 2
    item = (await client.get("/v1/rl/policies")).json()["items"][0]
    assert (item["samples"], item["reward"]["n"], item["reward"]["mean"]) == (2, 1, pytest.approx(0.5))
    assert (item["reward_sources"], item["judge_agreement"], item["reward"]["ci95"]) == (
        {"judge": 1, "terminal": 1}, None, None)


def test_contribution_of_a_judged_sample() -> None:
    meta = {"judge": {"score": 0.7, "source": "judge", "votes": [8, 6, "fail"]}, "completion_latency_ms": 120.0}
    ints, floats = contribution(meta, 17)
    assert ints == {"samples": 1, "tokens": 17, "reward_n": 1, "source:judge": 1, "judge_multi": 1, "lat_n": 1,
                    "lat_le:250": 1}
    assert floats == pytest.approx({"reward_sum": 0.7, "reward_sq": 0.49, "judge_spread": 0.2, "lat_sum_ms": 120.0})
    ints, floats = contribution({"judge": None}, 3)
    assert (ints, floats) == ({"samples": 1, "tokens": 3}, {})
    # A terminal reward is counted per Task by the reward transaction, not per sample.
    ints, floats = contribution({"judge": {"score": 1.0, "source": "terminal"}}, 3)
    assert (ints, floats) == ({"samples": 1, "tokens": 3, "source:terminal": 1}, {})


def test_summaries() -> None:
    assert reward_summary(0, 0, 0) == {"n": 0, "mean": None, "ci95": None}
    assert reward_summary(1, 0.5, 0.25) == {"n": 1, "mean": 0.5, "ci95": None}
    # Constant rewards: zero-width interval.
    assert reward_summary(4, 2.0, 1.0)["ci95"] == pytest.approx([0.5, 0.5])
    buckets = {"50": 10, "100": 10}
    assert quantile_ms(buckets, 0.5) == pytest.approx(50.0)
    assert quantile_ms(buckets, 0.75) == pytest.approx(75.0)
    assert quantile_ms({"+Inf": 3}, 0.5) == 120000.0
    assert quantile_ms({}, 0.5) is None
