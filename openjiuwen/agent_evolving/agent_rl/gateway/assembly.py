"""The one place that builds and wires every gateway part (CONTRACT §3): instances, health checks, the LoRA manager,
the RL Service supervisor and client, Task pinning, control, the inference proxy and the console. Each part gets what
it needs at construction; nothing is bound later."""

from __future__ import annotations

from collections.abc import Mapping

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..common import packed_hook
from .auth.hmac_auth import HmacVerifier
from .auth.lineage_access import LineageAccess
from .config import GatewayConfig
from .console.console import Console
from .console.console_auth import ConsoleAuth
from .http11 import Http11Client
from .instances.health import HealthMonitor, InstanceProbe
from .instances.instance_addresses import AddressPolicy
from .instances.instances import Instance, InstanceRegistry
from .lora.lora_manager import LoraManager
from .metrics import GatewayMetrics
from .proxy.inference import InferenceProxy
from .rl.control import RLControl
from .rl.rl_client import RLClient
from .rl.sessions import SessionMap
from .rl.supervisor import RLSupervisor
from .rl.tasks import TaskTracker


@dataclass
class Gateway:
    config: GatewayConfig
    model_id: str
    verifier: HmacVerifier
    loras: LoraManager
    supervisor: RLSupervisor
    rl: RLClient
    tracker: TaskTracker
    control: RLControl
    inference: InferenceProxy
    upstream: Http11Client
    registry: InstanceRegistry
    metrics: GatewayMetrics
    console: Console
    health: HealthMonitor
    ready: bool = False


def build_gateway(
    config: GatewayConfig, *, verifier: HmacVerifier, console_auth: ConsoleAuth, env: dict[str, str],
    agent_lineages: Mapping[str, frozenset[str]] | None = None,
    agent_lineage_caps: Mapping[str, int] | None = None,
) -> Gateway:
    """`agent_lineages`, `agent_lineage_caps`: the lineage limit and the registration cap of each agent key that has
    one (common/signing_keys.HmacKeys)."""
    online = config.online_rl
    model_id = online.model_id  # the gateway's own setting, checked against the child's /health
    metrics = GatewayMetrics(lineage_top_k=config.metrics.lineage_label_top_k,  # per app: its own CollectorRegistry
                             lineage_label_idle_s=config.metrics.lineage_label_idle_s)
    registry = InstanceRegistry(
        [Instance(i.name, i.model, i.instance_ip, int(i.port)) for i in config.instances],
        max_registered=config.registration.max_instances,
    )
    # Idle upstream connections close before vLLM's keep-alive timeout (5 s) could race a new request on them.
    upstream = Http11Client(keepalive_expiry_s=2.0, connect_timeout_s=10.0, max_idle_per_origin=256)
    checks = config.instance_health
    probe = InstanceProbe(checks.timeout_s)
    # A registration may not name the gateway's own port or its child's (on this host), nor an internal address
    # outside the networks the operator allowed.
    addresses = AddressPolicy(allowed_networks=config.registration.networks,
                              own_ports=(config.global_.listen_port, urlsplit(online.endpoint).port or 80),
                              resolve_timeout_s=checks.timeout_s)
    loras = LoraManager(
        registry, lora_root=config.lora.root, state_path=config.lora.state_path,
        operation_timeout_s=config.lora.operation_timeout_s, addresses=addresses,
        capture_registered=config.registration.capture_traffic, probe=probe,
        max_loras={i.name: i.max_loras for i in config.instances if i.max_loras is not None},
        max_loras_default=config.lora.max_loras_per_instance, page_timeout_s=config.lora.page_timeout_s,
        paging_metrics=metrics, task_reserved_slots=config.lora.task_reserved_slots,
        max_leased_versions=config.lora.max_leased_versions,
    )
    health = HealthMonitor(
        registry, readmit=loras.readmit, interval_s=checks.interval_s, timeout_s=checks.timeout_s,
        failure_threshold=checks.failure_threshold, probe=probe,
    )
    tracker = TaskTracker(SessionMap(), loras)
    supervisor = RLSupervisor(
        command=list(online.command), config_path=online.config_path, endpoint=online.endpoint,
        control_timeout_s=online.control_timeout_s, env=env, on_exit=tracker.service_exited, model_id=online.model_id,
        # The child's own output (a crash before its log file is set up) lands beside the gateway's LoRA state.
        log_dir=Path(config.lora.state_path).parent,
    )
    rl = RLClient(
        endpoint=online.endpoint, token=lambda: supervisor.token, hook_timeout_s=online.hook_timeout_s,
        hook_retries=online.hook_retries, control_timeout_s=online.control_timeout_s, metrics=metrics,
        packs_after=lambda: supervisor.accepts_hook_encoding(packed_hook.ENCODING),
    )
    control = RLControl(
        model_id=model_id, supervisor=supervisor, rl=rl, tracker=tracker, loras=loras,
        drain_timeout_s=online.drain_timeout_s, agent_lineages=agent_lineages or {},
        agent_lineage_caps=agent_lineage_caps or {},
    )
    inference = InferenceProxy(
        model_id=model_id, tracker=tracker, loras=loras, rl=rl, rl_running=control.running, upstream=upstream,
        max_upstream_bytes=config.global_.max_upstream_body_bytes, metrics=metrics, recheck=health.recheck,
        access=LineageAccess(verifier, agent_lineages=agent_lineages or {},
                             open_lineages=frozenset(config.lora.open_lineages)),
    )
    console = Console(auth=console_auth, control=control, loras=loras, supervisor=supervisor, model_id=model_id)
    return Gateway(
        config, model_id, verifier, loras, supervisor, rl, tracker, control, inference, upstream, registry, metrics,
        console, health,
    )
