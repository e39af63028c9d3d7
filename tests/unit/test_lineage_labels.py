"""The bounded `lineage` metric label (common/lineage_labels.py) and the gateway families that use it."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.config import MetricsSection
from openjiuwen.agent_evolving.agent_rl.common.lineage_labels import OTHER, LineageLabels
from openjiuwen.agent_evolving.agent_rl.gateway.metrics import GatewayMetrics, lineage_of_name


def test_a_thousand_lineages_give_at_most_top_k_plus_two_labels() -> None:
    labels = LineageLabels(20)
    seen = set()
    for _ in range(30):  # 1,000 lineages: the first 40 busy (20 requests a round), the rest once a round
        for n in range(1000):
            for _ in range(20 if n < 40 else 1):
                seen.add(labels.label(f"l{n}"))
        seen.add(labels.label("default"))
    assert len(labels.granted()) == 20 and labels.granted() <= {f"l{n}" for n in range(40)}
    assert seen == labels.granted() | {"default", OTHER}


def test_uniform_traffic_over_many_lineages_grants_no_label() -> None:
    labels = LineageLabels(20)  # no lineage stands out of the sketch: all `other`, memory bounded
    assert {labels.label(f"l{n}") for _ in range(30) for n in range(1000)} == {OTHER}


def test_heavy_lineages_win_the_slots_over_a_long_tail_seen_once() -> None:
    labels = LineageLabels(2, grant_after=5)
    for n in range(500):  # a long tail, each lineage once, interleaved with two busy ones
        labels.label(f"tail-{n}")
        labels.label("busy-a")
        labels.label("busy-b")
    assert labels.granted() == {"busy-a", "busy-b"}
    assert labels.label("tail-1") == OTHER


def test_a_granted_label_is_kept_so_series_do_not_flap() -> None:
    labels = LineageLabels(1, grant_after=2)
    assert [labels.label("a") for _ in range(2)] == [OTHER, "a"]
    for _ in range(100):
        assert labels.label("b") == OTHER  # busier now, but the slot stays a's
    assert labels.label("a") == "a"
    assert labels.known("a") == "a" and labels.known("b") == OTHER and labels.known("default") == "default"


def test_top_k_zero_labels_only_default() -> None:
    labels = LineageLabels(0)
    assert {labels.label(f"l{n}") for n in range(100) for _ in range(20)} == {OTHER}
    assert labels.label("default") == "default"
    with pytest.raises(ValueError):
        LineageLabels(-1)


def test_gateway_families_carry_the_mapped_label() -> None:
    metrics = GatewayMetrics(lineage_top_k=1)
    for _ in range(10):
        metrics.lineage_request("support", captured=True)
    for n in range(200):
        metrics.lineage_request(f"x{n}", captured=False)
    metrics.lineage_capture("support", "committed")
    metrics.lineage_capture("x3", "discarded")
    metrics.adapter_loaded("vllm-a", 0.1, "tiny:x7:v2")
    metrics.adapter_loaded("vllm-a", 0.1, "tiny:support:v1")
    text = metrics.render().decode()
    value = metrics.registry.get_sample_value
    # support's first 9 requests count as `other` until it reaches the grant threshold (10), then its own.
    assert value("gw_lineage_requests_total", {"lineage": "support", "captured": "true"}) == 1
    assert value("gw_lineage_requests_total", {"lineage": OTHER, "captured": "true"}) == 9
    assert value("gw_lineage_requests_total", {"lineage": OTHER, "captured": "false"}) == 200
    assert value("gw_lineage_captures_total", {"lineage": "support", "outcome": "committed"}) == 1
    assert value("gw_lineage_captures_total", {"lineage": OTHER, "outcome": "discarded"}) == 1
    assert value("gw_lineage_adapter_loads_total", {"lineage": OTHER}) == 1
    assert value("gw_lineage_adapter_loads_total", {"lineage": "support"}) == 1
    lineages = {line.split('lineage="')[1].split('"')[0] for line in text.splitlines() if 'lineage="' in line}
    assert lineages == {"support", OTHER}


def test_version_names_map_to_their_lineage_and_the_config_default_is_20() -> None:
    assert [lineage_of_name(n) for n in ("tiny:v3", "tiny:support:v1", "base", "tiny", None)] == [
        "default", "support", "default", "default", "default"]
    assert MetricsSection().lineage_label_top_k == 20


def test_traffic_outside_a_task_never_takes_a_label_slot() -> None:
    """Requests outside a Task are unauthenticated and may name any model: 20 made-up lineages x 10 requests each
    must leave the slots to the lineages whose Tasks run (captured traffic), which then get their own labels."""
    metrics = GatewayMetrics(lineage_top_k=2)
    for n in range(20):
        for _ in range(10):
            metrics.lineage_request(f"junk-{n}", captured=False)
    for _ in range(10):
        metrics.lineage_request("support", captured=True)
    assert metrics.lineages.granted() == frozenset({"support"})
    metrics.lineage_request("support", captured=False)  # a granted lineage keeps its label outside a Task too
    value = metrics.registry.get_sample_value
    assert value("gw_lineage_requests_total", {"lineage": "support", "captured": "false"}) == 1
    assert value("gw_lineage_requests_total", {"lineage": OTHER, "captured": "false"}) == 200


def test_lease_series_stay_bounded_with_many_lineages() -> None:
    """gw_lora_leases: the default line's versions and labelled lineages' keep their names, every other
    lineage's leases sum into `other` (1,000 lineages with running Tasks are not 1,000 series)."""
    metrics = GatewayMetrics(lineage_top_k=1)
    for _ in range(10):
        metrics.lineage_request("support", captured=True)
    counts = {"tiny:v3": 2, "tiny:support:v1": 1, **{f"tiny:u{n}:v1": 1 for n in range(1000)}}
    metrics.set_leases(counts)
    samples = [s for f in metrics.registry.collect() if f.name == "gw_lora_leases" for s in f.samples]
    assert {s.labels["lora_name"]: s.value for s in samples} == {"tiny:v3": 2, "tiny:support:v1": 1, OTHER: 1000}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_label_idle_past_its_period_frees_its_slot_for_a_busy_lineage() -> None:
    """Issue 37 item 7: lineages that took every slot (made up by one key, or stopped) once held them for the
    gateway's lifetime; a label idle for `idle_s` now goes to the next lineage that needs a slot."""
    clock, released = Clock(), []
    labels = LineageLabels(2, grant_after=2, idle_s=60.0, released=released.append, clock=clock)
    for name in ("junk-1", "junk-2"):
        assert [labels.label(name) for _ in range(2)] == [OTHER, name]
    clock.now = 30.0
    assert labels.label("junk-2") == "junk-2"  # junk-2 is still used; junk-1 idles from t=0
    assert [labels.label("real") for _ in range(3)] == [OTHER] * 3  # nobody idle past 60 s: no slot
    clock.now = 61.0
    assert [labels.label("real") for _ in range(2)] == [OTHER, "real"]  # junk-1 released, `real` counted in
    assert released == ["junk-1"] and labels.granted() == {"junk-2", "real"}
    clock.now = 89.0
    assert labels.label("junk-1") == OTHER  # it lost its slot; junk-2 (idle 59 s) keeps its own
    assert labels.granted() == {"junk-2", "real"}


def test_a_released_label_leaves_the_metrics_page() -> None:
    metrics = GatewayMetrics(lineage_top_k=1, lineage_label_idle_s=1e-9)
    for _ in range(10):
        metrics.lineage_request("junk", captured=True)
    metrics.lineage_capture("junk", "committed")
    metrics.adapter_loaded("vllm-a", 0.1, "tiny:junk:v1")
    assert 'lineage="junk"' in metrics.render().decode()
    for _ in range(10):  # `junk` has been idle past the (tiny) period: `real` takes the slot
        metrics.lineage_request("real", captured=True)
    text = metrics.render().decode()
    assert 'lineage="junk"' not in text and 'lineage="real"' in text
    assert metrics.lineages.granted() == {"real"}
