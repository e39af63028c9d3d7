"""Prometheus metrics of the reference gateway (`gw_` prefix): one `GatewayMetrics` per app on its own
`CollectorRegistry`. Requests by route and status, upstream (vLLM) latency, capture hook latency and errors are
recorded in-process as they happen; LoRA state per model and instance, instance health, leases and mapped Tasks are
read from the gateway's own memory at scrape time. Series labelled with an instance exist only while the instance
does: a removed instance's series are dropped at the next scrape, so registrations cannot grow the page for good."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..common.http_metrics import FAST_BUCKETS_S
from ..common.lineage import DEFAULT_LINEAGE, parse_version_name, split_line
from ..common.lineage_labels import DEFAULT_IDLE_S, OTHER, LineageLabels
from .instances.instances import InstanceRegistry
from .lora.lora_manager import LoraManager
from .lora.lora_types import LoraStatus
from .rl.sessions import SessionMap

UPSTREAM_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LORA_STATES = tuple(LoraStatus)


DEFAULT_LINEAGE_TOP_K = 20  # config `metrics.lineageLabelTopK`
CAPTURE_OUTCOMES = ("committed", "refused", "discarded")  # gw_lineage_captures_total{outcome}


class GatewayMetrics:
    def __init__(self, *, lineage_top_k: int = DEFAULT_LINEAGE_TOP_K,
                 lineage_label_idle_s: float = DEFAULT_IDLE_S) -> None:
        """`lineage_top_k`: lineages with their own `lineage` label beside `default`; `lineage_label_idle_s`: how
        long a label's lineage may go without traffic before another lineage may take its slot
        (common/lineage_labels.py)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("gw_http_requests_total", "Answers by route template and status",
                                     ("route", "status"), registry=r)
        self.upstream = Histogram("gw_upstream_duration_seconds",
                                  "vLLM time to response headers by instance and status",
                                  ("instance", "status"), buckets=UPSTREAM_BUCKETS_S, registry=r)
        self.hook_duration = Histogram("gw_capture_hook_duration_seconds",
                                       "RL Service hook calls (retries included) by hook",
                                       ("hook",), buckets=FAST_BUCKETS_S, registry=r)
        self.hook_errors = Counter("gw_capture_hook_errors_total",
                                   "Hook calls answered non-2xx (status) or not at all (unreachable)",
                                   ("hook", "status"), registry=r)
        self.lora_state = Gauge("gw_lora_state", "1 for the model's current LoRA state (base, active, degraded)",
                                ("model", "state"), registry=r)
        self.lora_instance_ready = Gauge("gw_lora_instance_ready",
                                         "1 when the instance serves the model's active policy (base: always)",
                                         ("model", "instance"), registry=r)
        self.instance_serving = Gauge("gw_instance_serving",
                                      "1 while the instance is in routing and the activation quorum (healthy and "
                                      "admitted), 0 while it is out", ("model", "instance"), registry=r)
        self.instances_registered = Gauge("gw_instances_registered",
                                          "Instances added through register-instance (static ones excluded)",
                                          registry=r)
        self.lora_leases = Gauge("gw_lora_leases", "Task leases held on a LoRA version", ("lora_name",),
                                 registry=r)
        self.tasks_mapped = Gauge("gw_tasks_mapped", "Active Tasks whose session the gateway captures", registry=r)
        self.rl_service_up = Gauge("gw_rl_service_up", "1 while the RL Service child is running", registry=r)
        self.rl_scrape_errors = Counter("gw_rl_scrape_errors_total",
                                        "Failed reads of the RL Service's /metrics while scraping", registry=r)
        # Adapter paging (lora/adapter_pager.py): on-demand and switch loads, and unloads to make room, per instance.
        self.adapter_loads = Counter("gw_lora_adapter_loads_total", "LoRA adapters loaded on an instance by the gateway",
                                     ("instance",), registry=r)
        self.adapter_evictions = Counter("gw_lora_adapter_evictions_total",
                                         "Idle LoRA adapters unloaded to make room on a full instance",
                                         ("instance",), registry=r)
        self.adapter_load_seconds = Histogram("gw_lora_adapter_load_duration_seconds",
                                              "Time of one LoRA load call that loaded the adapter",
                                              buckets=UPSTREAM_BUCKETS_S, registry=r)
        # Per lineage, through ONE bounded mapper (common/lineage_labels.py): at most top_k + 2 values per family.
        self.lineages = LineageLabels(lineage_top_k, idle_s=lineage_label_idle_s, released=self._drop_lineage)
        self.lineage_requests = Counter("gw_lineage_requests_total",
                                        "Inference requests by lineage (bounded label: top lineages, default, other) "
                                        "and whether captured", ("lineage", "captured"), registry=r)
        self.lineage_captures = Counter("gw_lineage_captures_total",
                                        "Ended captures by lineage (bounded) and outcome (committed, refused, "
                                        "discarded)", ("lineage", "outcome"), registry=r)
        self.lineage_adapter_loads = Counter("gw_lineage_adapter_loads_total",
                                             "LoRA adapters loaded by the gateway, by the version's lineage (bounded)",
                                             ("lineage",), registry=r)
        self._upstream_statuses: dict[str, set[str]] = {}  # instance → status labels observed (for removal)

    def http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def upstream_answered(self, instance: str, status: str, seconds: float) -> None:
        self.upstream.labels(instance, status).observe(seconds)
        self._upstream_statuses.setdefault(instance, set()).add(status)

    def adapter_loaded(self, instance: str, seconds: float, lora_name: str) -> None:
        self.adapter_loads.labels(instance).inc()
        self.adapter_load_seconds.observe(seconds)
        self.lineage_adapter_loads.labels(self.lineages.known(lineage_of_name(lora_name))).inc()

    def lineage_request(self, lineage: str, *, captured: bool) -> None:
        """One inference request of `lineage`. Only captured requests (a Task's, started with a signed call) rank
        lineages for a label: traffic outside a Task is unauthenticated and names any model it likes, so made-up
        names must not take the label slots from real lineages."""
        label = self.lineages.label(lineage) if captured else self.lineages.known(lineage)
        self.lineage_requests.labels(label, "true" if captured else "false").inc()

    def _drop_lineage(self, lineage: str) -> None:
        """A label was released: its series leave the page (the lineage counts under `other` from now on)."""
        series = [(self.lineage_requests, (lineage, captured)) for captured in ("true", "false")]
        series += [(self.lineage_captures, (lineage, outcome)) for outcome in CAPTURE_OUTCOMES]
        series.append((self.lineage_adapter_loads, (lineage,)))
        for family, labels in series:
            with suppress(KeyError):  # a series it never had
                family.remove(*labels)

    def lineage_capture(self, lineage: str, outcome: str) -> None:
        self.lineage_captures.labels(self.lineages.known(lineage), outcome).inc()

    def adapter_evicted(self, instance: str) -> None:
        self.adapter_evictions.labels(instance).inc()

    @contextmanager
    def hook(self, hook: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.hook_duration.labels(hook).observe(time.perf_counter() - started)

    def hook_error(self, hook: str, status: str) -> None:
        self.hook_errors.labels(hook, status).inc()

    def refresh(self, *, loras: LoraManager, instances: InstanceRegistry, sessions: SessionMap, model_id: str,
                rl_running: bool) -> None:
        """Set the state gauges from the gateway's memory (no I/O)."""
        # A registered instance may name any model; one with a `:` is no model id (no line of ours).
        models = [m for m in dict.fromkeys([model_id, *instances.models()]) if ":" not in m]
        self.lora_instance_ready.clear()  # set again below for the instances that exist now
        self.instance_serving.clear()
        for model in models:
            status = loras.status(model)
            for state in LORA_STATES:
                self.lora_state.labels(model, state).set(1 if status["status"] == state else 0)
            active = loras.active(model)
            for instance in instances.for_model(model):
                ready = active is None or loras.holdings.holds(instance.name, active.lora_name)
                self.lora_instance_ready.labels(model, instance.name).set(1 if ready else 0)
                self.instance_serving.labels(model, instance.name).set(1 if instances.is_serving(instance.name) else 0)
        self.instances_registered.set(instances.registered_count())
        for name in [n for n in self._upstream_statuses if n not in instances]:  # removed instances
            for status in self._upstream_statuses.pop(name):
                self.upstream.remove(name, status)
            for family in (self.adapter_loads, self.adapter_evictions):
                with suppress(KeyError):
                    family.remove(name)
        self.set_leases(loras.leases.counts())
        self.tasks_mapped.set(len(sessions.all_tasks()))
        self.rl_service_up.set(1 if rl_running else 0)

    def set_leases(self, counts: Mapping[str, int]) -> None:
        """One series per leased version of the default line and of the lineages with a label; every other
        lineage's versions sum into `other`, so thousands of lineages with running Tasks stay a bounded family."""
        leases: dict[str, int] = {}
        for name, count in counts.items():
            lineage = lineage_of_name(name)
            key = name if lineage == DEFAULT_LINEAGE or self.lineages.known(lineage) != OTHER else OTHER
            leases[key] = leases.get(key, 0) + count
        self.lora_leases.clear()
        for name, count in leases.items():
            self.lora_leases.labels(name).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def lineage_of_name(name: object) -> str:
    """The lineage of a version name `<line>:vN`; `default` for the base model or any other name."""
    parsed = parse_version_name(name)  # a parsed version's line is well formed
    return DEFAULT_LINEAGE if parsed is None else split_line(parsed[0])[1]
