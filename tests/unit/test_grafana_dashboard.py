"""The shipped Grafana dashboard parses, and every metric it queries is one the service or the gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from openjiuwen.agent_evolving.agent_rl.gateway.metrics import GatewayMetrics
from openjiuwen.agent_evolving.agent_rl.online.metrics import ServiceMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "online-rl-dashboard.json"
METRIC = re.compile(r"\b((?:rl|gw)_[a-z0-9_]+)")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def exported() -> set[str]:
    """Every series name the two registries can produce (histograms with their three series)."""
    names: set[str] = set()
    for text in (ServiceMetrics("m").render().decode(), GatewayMetrics().render().decode()):
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                if name.endswith("_created"):
                    continue  # the client library's creation timestamps, not a metric of ours
                names |= {name + s for s in HISTOGRAM_SERIES} if kind == "histogram" else {name}
    return names


def targets(panels: list[dict]) -> list[str]:
    out = []
    for panel in panels:
        out += [t["expr"] for t in panel.get("targets", [])]
        out += targets(panel.get("panels", []))
    return out


def test_dashboard_parses_and_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    exprs = targets(dashboard["panels"])
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used - exported() == set()
    # Every exported metric family is on the dashboard somewhere.
    families = {n.removesuffix(s) for n in exported() for s in ("",) + HISTOGRAM_SERIES if n.endswith(s) and s}
    families |= {n for n in exported() if not n.endswith(HISTOGRAM_SERIES)}
    on_dashboard = {n.removesuffix(s) for n in used for s in HISTOGRAM_SERIES if n.endswith(s)} | used
    assert families - on_dashboard == set()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
