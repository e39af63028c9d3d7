"""`openjiuwen-rl gateway --config FILE`: run the reference gateway (the one place that reads its environment)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="openjiuwen-rl gateway",
        description="Run the reference gateway: inference proxy with capture, LoRA manager, RL Service supervisor.",
    )
    parser.add_argument("--config", required=True, help="gateway JSON config (AIGW shape); see docs/gateway.md")
    parser.add_argument("--log-level", default="INFO", help="log level of the gateway's stderr log (default INFO)")
    return parser.parse_args(argv)


async def _serve(config_path: str) -> int:
    from ..common.gc_tuning import tune_gc
    from ..common.quiet_server import QuietServer
    from ..common.slow_clients import ConnectionLimits, server_config
    from .app import build_gateway, create_gateway_app
    from .auth.hmac_auth import HmacVerifier
    from .config import GatewayConfigError, load_gateway_config, load_hmac_keys
    from .console.console_auth import ConsoleAuth

    try:
        config = load_gateway_config(config_path)
        keys = await load_hmac_keys(config)
    except (GatewayConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verifier = HmacVerifier(keys.api, keys.ins, agent_keys=keys.agents,
                            replay_capacity=config.global_.replay_cache_size,
                            accept_legacy=config.global_.accept_legacy_signatures)
    if config.global_.accept_legacy_signatures:
        logging.getLogger("openjiuwen.agent_rl.gateway").warning(
            "global.acceptLegacySignatures is on: AIGW-form signatures (method, path and query unsigned) are accepted")
    gateway = build_gateway(config, verifier=verifier, console_auth=ConsoleAuth(keys.api), env=dict(os.environ),
                            agent_lineages=keys.agent_lineages, agent_lineage_caps=keys.agent_lineage_caps)
    app = create_gateway_app(gateway)
    tune_gc()
    host, _, port = config.global_.listen.rpartition(":")
    limits = ConnectionLimits(header_timeout_s=config.global_.header_timeout_s,
                              keep_alive_s=config.global_.keep_alive_timeout_s,
                              max_connections=config.global_.max_connections)
    # Raises the soft open-files limit to the hard one first (the RL Service child inherits it).
    server = QuietServer(server_config(app, host=host.strip("[]") or "127.0.0.1", port=int(port), limits=limits,
                                          name="gateway", log_config=None, access_log=False,
                                          timeout_graceful_shutdown=30))
    await server.serve()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    from ..common.log_format import EscapingFormatter

    args = _parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter())  # messages quote registrations and vLLM errors: one line each
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    # uvicorn re-raises SIGTERM after its graceful shutdown; a requested stop is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import uvloop  # the proxy's per-request work is mostly event-loop work: uvloop's loop does it in C

    return uvloop.run(_serve(args.config))


if __name__ == "__main__":
    sys.exit(main())
