"""Who may change the gateway's vLLM instances, and what a dead one may do to the rest (issue 19, items 2 and 4), with
real processes: gateway + RL Service child (scripted trainer) + private Redis + fake vLLM instances on loopback.

The attacks: a holder of the instance key re-registers an existing name at its own address to receive the agents'
prompts (and feed completions into training data); registrations at closed ports block every activation and grow the
registry and `/metrics` without bound.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_FILE_ENV, URL_ENV, main
from openjiuwen.agent_evolving.agent_rl.gateway.instances.health import RECHECK_MIN_GAP_S
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import INS_KEY, LOOPBACK_REGISTRATION, GatewayProcess
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for
from tests.system.test_gateway_lora import (
    activate_v1,
    agent,
    chat,
    chats_since,
    lora_status,
    marks,
    rewarded_sample,
    start_task,
    train,
    wait_run,
)

pytestmark = pytest.mark.system

REGISTER = "/aigw/v1/register-instance"
UNREGISTER = "/aigw/v1/unregister-instance"
LIST = "/aigw/v1/instances"
# Fast checks for the test that watches an instance die and come back.
FAST_HEALTH = {"interval": "200ms", "timeout": "2s", "failureThreshold": 3}
WAIT_S = 15.0


@pytest.fixture
def vllm() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


def register(gw: GatewayProcess, body: dict[str, Any], key: bytes = INS_KEY) -> httpx.Response:
    return gw.signed("POST", REGISTER, json=body, key=key)


def error_code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def instances(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    r = gw.signed("GET", LIST)
    assert r.status_code == 200, r.text
    return {i["name"]: i for i in r.json()["items"]}


def base_chats(gw: GatewayProcess, n: int) -> None:
    """`n` uncaptured completions without a session: least in flight, then round robin over the serving instances."""
    client = agent(gw)
    for k in range(n):
        chat(client, None, f"q{k}")


def received(v: FakeVLLM) -> int:
    return v.count(CHAT_PATH)


def at(fake: FakeVLLM, *, name: str) -> dict[str, Any]:
    """A registration under `name` that points at `fake`'s address."""
    return {**fake.registration(), "name": name}


def closed_port_registration(name: str) -> dict[str, Any]:
    return {"name": name, "model": "tiny", "instanceIp": "127.0.0.1", "port": str(free_port()), "role": "mixed",
            "groupID": "", "dpRank": -1}


# ---------------------------------------------------------------------------------------------------- item 2


def test_static_instance_cannot_be_taken_over_by_registration(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], extra_config=LOOPBACK_REGISTRATION) as gw, \
            FakeVLLM(name="rogue") as rogue:
        for key in (INS_KEY, gw.api_key):  # config-owned: not even the operator key moves it at run time
            r = register(gw, at(rogue, name="vllm-a"), key=key)
            assert error_code(r) == (409, "instance_static"), r.text
        # The static instance registering itself is an idempotent repeat.
        assert register(gw, a.registration()).json() == {"status": "registered", "name": "vllm-a", "serving": True}

        mark = marks([a, b])
        base_chats(gw, 6)

        assert received(rogue) == 0
        assert sorted(name for name, _ in chats_since([a, b], mark)) == ["vllm-a"] * 3 + ["vllm-b"] * 3
        listed = instances(gw)
        assert listed["vllm-a"]["address"] == f"127.0.0.1:{a.port}" and listed["vllm-a"]["origin"] == "static"
        r = gw.signed("POST", UNREGISTER, json={"name": "vllm-a"})
        assert error_code(r) == (409, "instance_static"), r.text


def test_registered_instance_moves_only_after_an_operator_removes_it(
    redis, redis_url, tmp_path, vllm, capsys: pytest.CaptureFixture[str]
):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], extra_config=LOOPBACK_REGISTRATION) as gw, \
            FakeVLLM(name="vllm-c") as c, FakeVLLM(name="rogue") as rogue:
        first = register(gw, c.registration())
        assert first.status_code == 200, first.text

        r = register(gw, at(rogue, name="vllm-c"))  # the takeover: same name, the attacker's address
        assert error_code(r) == (409, "instance_conflict"), r.text
        assert first.json() == {"status": "registered", "name": "vllm-c", "serving": True}
        assert register(gw, c.registration()).status_code == 200  # the instance itself may repeat
        base_chats(gw, 6)
        assert received(rogue) == 0 and received(c) == 2
        assert 'instance="vllm-c"' in gw.http.get("/metrics").text

        # Removal is the operator's: the instance key is refused, like a missing signature.
        r = gw.signed("POST", UNREGISTER, json={"name": "vllm-c"}, key=INS_KEY)
        assert error_code(r) == (401, "invalid_signature"), r.text
        assert "vllm-c" in instances(gw)
        r = gw.signed("POST", UNREGISTER, json={"name": "nobody"})
        assert error_code(r) == (404, "instance_not_found"), r.text
        env = {KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url}
        assert main(["instance", "remove", "vllm-c"], env=env) == 0
        assert "instance vllm-c removed" in capsys.readouterr().out

        assert "vllm-c" not in instances(gw)
        base_chats(gw, 4)
        assert received(c) == 2  # nothing new
        page = gw.http.get("/metrics").text
        assert "vllm-c" not in page, [line for line in page.splitlines() if "vllm-c" in line][:5]
        # The name is free again: an operator-approved move.
        assert register(gw, at(rogue, name="vllm-c")).status_code == 200
        assert main(["instance", "list"], env=env) == 0
        out = capsys.readouterr().out
        assert re.search(rf"vllm-c\s+tiny\s+127\.0\.0\.1:{rogue.port}\s+registered\s+yes", out), out


def test_registered_instances_are_capped(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    registration = {**LOOPBACK_REGISTRATION["registration"], "maxInstances": 2}
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], extra_config={"registration": registration}) as gw:
        assert register(gw, closed_port_registration("r1")).status_code == 200
        assert register(gw, closed_port_registration("r2")).status_code == 200
        r = register(gw, closed_port_registration("r3"))
        assert error_code(r) == (409, "instance_limit_reached"), r.text
        assert "registration.maxInstances" in r.json()["error"]["message"]
        assert sorted(instances(gw)) == ["r1", "r2", "vllm-a", "vllm-b"]  # static ones do not count
        assert gw.signed("POST", UNREGISTER, json={"name": "r2"}).status_code == 200
        assert register(gw, closed_port_registration("r3")).status_code == 200
        assert gw.signed("GET", LIST).json()["registered"] == 2


# ---------------------------------------------------------------------------------------------------- item 4


def test_dead_instances_neither_block_activation_nor_receive_traffic(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    # Default health settings: no periodic check can notice c's death within this test (3 failures, 10 s apart);
    # only the registration probe and the activation's refused connection do.
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], rl_overrides={"lora_activation_attempts": 1},
                        extra_config=LOOPBACK_REGISTRATION) as gw, FakeVLLM(name="vllm-c") as c:
        client = agent(gw)
        gw.start_service()
        # Registered at a closed port: the registration probe keeps it out of routing at once.
        ghost = register(gw, closed_port_registration("ghost"))
        assert ghost.status_code == 200, ghost.text
        assert register(gw, c.registration()).status_code == 200
        rewarded_sample(gw, client, "train-v1")
        c.stop()  # dies after it served

        started = gw.signed("POST", "/v1/rl/training/runs")
        run = wait_run(gw, started.json()["training_run_id"])

        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v1"), run  # c refused: out of the quorum
        assert ghost.json() == {"status": "registered", "name": "ghost", "serving": False}
        assert [v.loaded for v in (a, b)] == [{"tiny:v1"}] * 2
        assert lora_status(gw)["instances"] == {"ready": 2, "failed": 0}
        assert {n: i["serving"] for n, i in instances(gw).items()} == {
            "vllm-a": True, "vllm-b": True, "ghost": False, "vllm-c": False}
        task = start_task(gw, "pinned")
        assert task["policy_model"] == "tiny:v1"
        mark = marks([a, b])
        for n in range(4):
            chat(client, "pinned", f"turn {n}")
        base_chats(gw, 4)  # every one answered: none went to ghost or c
        assert len(chats_since([a, b], mark)) == 8


def test_instance_that_comes_back_gets_the_active_and_leased_adapters_before_it_serves(
    redis, redis_url, tmp_path, vllm
):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b],
                        extra_config={"instanceHealth": FAST_HEALTH, **LOOPBACK_REGISTRATION}) as gw, \
            FakeVLLM(name="vllm-c") as c:
        client = agent(gw)
        gw.start_service()
        v1_path = activate_v1(gw, client)
        assert register(gw, c.registration()).json()["serving"] is True
        assert c.loaded_paths == {"tiny:v1": v1_path}
        old = start_task(gw, "on-v1")  # pins v1: a leased version

        c.stop()
        wait_for(lambda: not instances(gw)["vllm-c"]["serving"], WAIT_S, "the dead instance leaves routing")
        run = train(gw, client, "train-v2")
        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v2"), run
        v2_path = run["lora_path"]
        assert lora_status(gw)["instances"] == {"ready": 2, "failed": 0}

        # vLLM restarts at the same address with nothing loaded.
        with FakeVLLM(name="vllm-c", port=c.port) as back:
            wait_for(lambda: instances(gw)["vllm-c"]["serving"], WAIT_S, "the instance comes back")
            # It serves only after both loads: the active version and the one the running Task still holds.
            assert back.loaded_paths == {"tiny:v1": v1_path, "tiny:v2": v2_path}
            assert lora_status(gw)["instances"] == {"ready": 3, "failed": 0}
            mark = marks([a, b, back])
            for n in range(6):
                chat(client, "on-v1", f"turn {n}")
            sent = chats_since([a, b, back], mark)
            assert {body["model"] for _, body in sent} == {"tiny:v1"}
            assert [name for name, _ in sent].count("vllm-c") == 2  # round robin over the three holders
            assert old["policy_model"] == "tiny:v1"


# ---------------------------------------------------------------------------------------------------- issue 28, item 1


def test_registration_refuses_the_gateways_own_host_and_internal_addresses(redis, redis_url, tmp_path, vllm):
    """The instance key named the RL child's port (its unauthenticated /health answers 200), the gateway's own port,
    a metadata address: each was admitted, and every activation then failed on it (502) while plain completions
    routed there got 401. With the default config every internal address is refused before anything is probed."""
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], rl_overrides={"lora_activation_attempts": 1}) as gw:
        gw.start_service()
        client = agent(gw)
        own_port, internal = "gateway's own or its RL Service's port", "registration.allowedNetworks"
        targets = {  # name: (instanceIp, port, what the refusal says)
            "rl-child": ("127.0.0.1", gw.rl_port, own_port), "gateway": ("127.0.0.1", gw.port, own_port),
            "metadata": ("169.254.169.254", 80, internal), "unspecified": ("0.0.0.0", 6379, internal),
            "v6-loopback": ("::1", 6379, internal), "v4-mapped": ("::ffff:127.0.0.1", 6379, internal),
            "by-name": ("localhost", 6379, internal), "multicast": ("224.0.0.1", 80, internal),
            "broadcast": ("255.255.255.255", 80, internal),
            "vllm-a-twin": (a.host, a.port, internal),  # loopback too, even where a real vLLM answers
        }
        for name, (host, port, says) in targets.items():
            r = register(gw, {"name": name, "model": "tiny", "instanceIp": host, "port": port})
            assert error_code(r) == (400, "instance_address_refused"), (name, r.text)
            assert says in r.json()["error"]["message"], (name, r.text)
        assert sorted(instances(gw)) == ["vllm-a", "vllm-b"]

        run = train(gw, client, "train-v1")  # nothing registered can fail it
        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v1"), run
        assert lora_status(gw)["instances"] == {"ready": 2, "failed": 0}
        mark = marks([a, b])
        base_chats(gw, 4)
        assert len(chats_since([a, b], mark)) == 4


def test_allowed_networks_admit_loopback_instances_but_never_the_gateways_own_ports(redis, redis_url, tmp_path, vllm):
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], extra_config=LOOPBACK_REGISTRATION) as gw, \
            FakeVLLM(name="vllm-c") as c:
        gw.start_service()
        for port in (gw.port, gw.rl_port):  # whatever the list says
            r = register(gw, {"name": f"own-{port}", "model": "tiny", "instanceIp": "127.0.0.1", "port": port})
            assert error_code(r) == (400, "instance_address_refused"), r.text
        r = register(gw, {"name": "metadata", "model": "tiny", "instanceIp": "169.254.169.254", "port": 80})
        assert error_code(r) == (400, "instance_address_refused"), r.text  # outside the allowed network
        assert register(gw, c.registration()).json() == {"status": "registered", "name": "vllm-c", "serving": True}
        # A name is resolved once and the instance kept at the address checked.
        r = register(gw, {"name": "named", "model": "tiny", "instanceIp": "localhost", "port": str(c.port)})
        assert r.json()["serving"] is True, r.text
        assert instances(gw)["named"]["address"] == f"127.0.0.1:{c.port}"


def test_a_registered_instance_that_fails_an_activation_leaves_routing_for_that_version_only(
    redis, redis_url, tmp_path, vllm
):
    """A registered instance answering every load with an error made every activation roll back (502) and every
    Training Run fail. Now it stays out of that version's routing (the model `degraded` until a retry loads it) and
    the version serves from the others; static instances keep the all-or-nothing rule."""
    a, b = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a, b], rl_overrides={"lora_activation_attempts": 1},
                        extra_config=LOOPBACK_REGISTRATION) as gw, FakeVLLM(name="vllm-c") as c:
        gw.start_service()
        client = agent(gw)
        assert register(gw, c.registration()).json()["serving"] is True
        c.fail_loads = True

        run = train(gw, client, "train-v1")

        assert (run["status"], run["lora_name"]) == ("succeeded", "tiny:v1"), run
        assert [v.loaded for v in (a, b, c)] == [{"tiny:v1"}, {"tiny:v1"}, set()]
        status = lora_status(gw)
        assert (status["status"], status["instances"]) == ("degraded", {"ready": 2, "failed": 1}), status
        listed = instances(gw)
        assert listed["vllm-c"]["serving"] is True and listed["vllm-c"]["loaded"] == []
        mark = marks([a, b, c])
        for n in range(6):  # outside a Task, naming the active version
            out = client.chat.completions.create(model="tiny:v1", messages=[{"role": "user", "content": f"q{n}"}],
                                                 max_tokens=4)
            assert out.choices[0].message.content
        assert sorted({name for name, _ in chats_since([a, b, c], mark)}) == ["vllm-a", "vllm-b"]

        c.fail_loads = False  # the repair path (GET /v1/loras retries first, and every 30 s) brings it back
        assert lora_status(gw)["instances"] == {"ready": 3, "failed": 0}
        assert c.loaded == {"tiny:v1"}

        a.fail_loads = True  # a static instance that fails still fails the activation for everyone
        run = train(gw, client, "train-v2")
        assert run["status"] == "failed" and "vllm-a" in run["failure_reason"], run
        assert lora_status(gw)["active_lora"]["lora_name"] == "tiny:v1"


# ---------------------------------------------------------------------------------------------------- issue 28 item 2


def samples_by_instance(gw: GatewayProcess) -> dict[str, list[str]]:
    """instance → statuses of the samples it served (one page is enough here)."""
    r = gw.signed("GET", "/v1/rl/trajectories", params={"limit": "1000"})
    assert r.status_code == 200, r.text
    out: dict[str, list[str]] = {}
    for item in r.json()["items"]:
        out.setdefault(item["instance"], []).append(item["status"])
    return out


def test_samples_record_their_instance_and_an_operator_excludes_a_rogue_ones(
    redis, redis_url, tmp_path, vllm, capsys: pytest.CaptureFixture[str]
):
    """A registered instance could feed made-up token ids into training data and nobody could tell which samples it
    served. Now each sample names its instance, and the operator (only) excludes that instance's samples."""
    a, _ = vllm
    with GatewayProcess(tmp_path, redis_url, instances=[a], extra_config=LOOPBACK_REGISTRATION) as gw, \
            FakeVLLM(name="rogue") as rogue:
        gw.start_service()
        client = agent(gw)
        assert register(gw, rogue.registration()).json()["serving"] is True  # captureTraffic is on by default
        # Sessions go by rendezvous hash: enough of them reach both instances.
        for k in range(8):
            rewarded_sample(gw, client, f"s{k}")
        served = samples_by_instance(gw)
        assert set(served) == {"vllm-a", "rogue"} and all(s == "pending" for v in served.values() for s in v), served
        n_rogue = len(served["rogue"])
        assert n_rogue == received(rogue)

        # The instance key cannot do it (a rogue host would exclude the honest ones).
        r = gw.signed("POST", "/v1/rl/trajectories/exclude", json={"instance": "vllm-a"}, key=INS_KEY)
        assert error_code(r) == (401, "invalid_signature"), r.text
        r = gw.signed("POST", "/v1/rl/trajectories/exclude", json={"instance": ["rogue"]})
        assert error_code(r) == (400, "invalid_request"), r.text
        env = {KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url}
        assert main(["traj", "exclude", "--instance", "rogue"], env=env) == 0
        assert f"instance rogue excluded: {n_rogue} sample(s) moved to `excluded`" in capsys.readouterr().out

        served = samples_by_instance(gw)
        assert served["rogue"] == ["excluded"] * n_rogue and set(served["vllm-a"]) == {"pending"}, served
        # What it serves afterwards is filed `excluded` at publication.
        before = received(rogue)
        k = 100
        while received(rogue) == before:
            rewarded_sample(gw, client, f"s{k}")
            k += 1
        assert samples_by_instance(gw)["rogue"] == ["excluded"] * (n_rogue + 1)
        assert main(["traj", "list", "--status", "excluded"], env=env) == 0
        rows = capsys.readouterr().out.splitlines()[1:]
        assert len(rows) == n_rogue + 1 and all(row.split()[5] == "rogue" for row in rows), rows


def test_with_capture_traffic_off_registered_instances_serve_bypass_traffic_only(redis, redis_url, tmp_path, vllm):
    a, _ = vllm
    registration = {**LOOPBACK_REGISTRATION["registration"], "captureTraffic": False}
    with GatewayProcess(tmp_path, redis_url, instances=[a], extra_config={
                        "registration": registration, "instanceHealth": FAST_HEALTH}) as gw, \
            FakeVLLM(name="vllm-c") as c:
        gw.start_service()
        client = agent(gw)
        assert register(gw, c.registration()).json()["serving"] is True
        for k in range(6):
            rewarded_sample(gw, client, f"s{k}")
        assert received(c) == 0 and set(samples_by_instance(gw)) == {"vllm-a"}
        base_chats(gw, 4)  # outside Tasks the registered instance serves as before
        assert received(c) == 2

        # With the static instance out of routing, captured requests have nowhere to go: 503, nothing captured.
        a.fail_next("/health", 503, times=10_000)
        wait_for(lambda: not instances(gw)["vllm-a"]["serving"], timeout_s=WAIT_S)
        task = start_task(gw, "s-late")
        r = gw.http.post("/v1/chat/completions", headers={"X-Agent-Session-Id": "s-late"},
                         json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert error_code(r) == (503, "no_capture_instances"), r.text
        assert received(c) == 2
        base_chats(gw, 2)
        assert received(c) == 4
        r = gw.signed("GET", f"/v1/rl/tasks/{task['rl_task_id']}")
        assert r.json()["status"] == "active", r.text


# ---------------------------------------------------------------------------------------------------- issue 28 item 12


def test_a_vllm_that_comes_up_after_the_first_probe_serves_the_next_request_not_a_probe_interval_later(
    redis, redis_url, tmp_path
):
    """Gateway started beside a loading vLLM: the start-up probe finds it down, and until the next round (10 s by
    default) every request got 503 `no_healthy_instances`. Now a request that finds no healthy instance probes at
    once (single-flight) and is served by an instance that answers."""
    late = FakeVLLM(name="vllm-late", port=free_port())  # not listening yet: its start-up probe is refused
    slow_rounds = {"interval": "60s", "timeout": "2s", "failureThreshold": 3}  # no periodic round during the test
    with GatewayProcess(tmp_path, redis_url, instances=[late], extra_config={"instanceHealth": slow_rounds}) as gw:
        assert instances(gw)["vllm-late"]["serving"] is False
        client = agent(gw)
        # Still down: the immediate probe fails too and the request gets today's 503.
        r = gw.http.post(CHAT_PATH, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert error_code(r) == (503, "no_healthy_instances"), r.text
        time.sleep(RECHECK_MIN_GAP_S)  # a request right after that 503 reuses its result rather than probing again
        with late:
            # vLLM is up: the very next requests are served, well within the 60 s probe interval.
            for k in range(3):
                chat(client, None, f"q{k}")
            assert received(late) == 3 and instances(gw)["vllm-late"]["serving"] is True
