"""Adapter paging under many lineages (issue 27 item 6, docs/lineages.md "## Gateway"): lines registered (each with an
activated version), some of them with concurrent traffic, instances with a few LoRA slots each.

    .venv/bin/python bench/lineage_paging_bench.py [--quick] [--lines 1000] [--hot 64] [--instances 2] [--slots 8]
        [--requests 8000] [--load-delay-ms 0] [--think-ms 5] [--out FILE]

In process: the gateway's LoRA manager (activation through the one switch routine, the state file, routing and the
adapter pager) over fake vLLM instances on loopback sockets that refuse a load past `--slots` (so the run also proves
that no instance ever holds more). Each of `--hot` workers sends completions pinned to its own line's version: the
routing pick, `page_in` (on-demand load, LRU unload of idle adapters), then the chat call straight to the instance;
the HTTP proxy in front is not part of it (bench/load_bench.py measures that). Each worker pauses `--think-ms`
between its completions (an agent's own work): an adapter with back-to-back traffic is never idle, so it is never
unloaded, and without pauses the first lines to get slots keep them. `--load-delay-ms` makes every fake
load take that long (a real vLLM loads a small LoRA in tens of milliseconds). Prints the activation time per line,
adapter load latency p50/p95 (the pager's loads under traffic), loads, evictions, completions per second and the
peak adapters per instance; there is no target. `--quick` (< 1 minute): 1000 lines, 64 hot, 2000 completions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from ipaddress import ip_network
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openjiuwen.agent_evolving.agent_rl.gateway.instances.instance_addresses import AddressPolicy  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.gateway.instances.instances import Instance, InstanceRegistry  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraManager  # noqa: E402
from tests.support.fake_vllm import CHAT_PATH, LOAD_PATH, FakeVLLM  # noqa: E402

MODEL = "tiny"


class Recorder:
    def __init__(self) -> None:
        self.load_s: list[float] = []
        self.evictions = 0

    def adapter_loaded(self, instance: str, seconds: float, lora_name: str) -> None:
        self.load_s.append(seconds)

    def adapter_evicted(self, instance: str) -> None:
        self.evictions += 1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    fakes = [FakeVLLM(served_model=MODEL, name=f"vllm-{i}", max_loras=args.slots) for i in range(args.instances)]
    await asyncio.gather(*(f.astart() for f in fakes))
    recorder = Recorder()
    registry = InstanceRegistry([Instance(f.name, MODEL, f.host, f.port) for f in fakes])
    loras = LoraManager(registry, lora_root=tmp / "loras", state_path=tmp / "state.json", operation_timeout_s=30.0,
                        addresses=AddressPolicy(allowed_networks=[ip_network("127.0.0.0/8")]),
                        max_loras_default=args.slots, page_timeout_s=30.0, paging_metrics=recorder)
    client = httpx.AsyncClient(trust_env=False, timeout=30.0, limits=httpx.Limits(max_connections=args.hot * 2))
    try:
        await loras.restore()
        lines = [f"{MODEL}:l{i}" for i in range(args.lines)]
        started = time.perf_counter()
        for line in lines:
            path = tmp / "loras" / line.replace(":", "-") / "v1"
            path.mkdir(parents=True)
            await loras.activate(base_model="/models/tiny", lora_name=f"{line}:v1", lora_path=str(path),
                                 expected_lora_name="base")
        activate_s = time.perf_counter() - started
        for fake in fakes:
            if args.load_delay_ms:
                fake.delay_next(LOAD_PATH, args.load_delay_ms / 1000, times=10**6)
        recorder.load_s.clear()
        evictions_before = recorder.evictions
        hot = lines[: args.hot]
        per_worker = max(1, args.requests // args.hot)
        wrong = 0

        async def worker(line: str) -> None:
            nonlocal wrong
            version = f"{line}:v1"
            for _ in range(per_worker):
                with contextlib.ExitStack() as counts:
                    instance = loras.routing.pick(MODEL, version, captured=True)
                    counts.enter_context(loras.routing.in_flight(instance))  # as the gateway: before the page-in
                    await loras.page_in(instance, version, counts)
                    r = await client.post(instance.base_url + CHAT_PATH, content=orjson.dumps(
                        {"model": version, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                        headers={"content-type": "application/json"})
                    if r.status_code != 200 or r.json().get("model") != version:
                        wrong += 1
                # An agent thinks between calls: its adapter is idle then, and may be the victim of another line.
                await asyncio.sleep(args.think_ms / 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker(line) for line in hot))
        traffic_s = time.perf_counter() - started
        done = per_worker * len(hot)
        return {
            "lines": args.lines, "hot": args.hot, "instances": args.instances, "slots": args.slots,
            "load_delay_ms": args.load_delay_ms, "think_ms": args.think_ms,
            "activation_ms_per_line": round(activate_s / args.lines * 1000, 2),
            "completions": done, "failed_or_wrong_adapter": wrong,
            "completions_per_s": round(done / traffic_s, 1),
            "loads": len(recorder.load_s), "evictions": recorder.evictions - evictions_before,
            "load_p50_ms": round(percentile(recorder.load_s, 50) * 1000, 2),
            "load_p95_ms": round(percentile(recorder.load_s, 95) * 1000, 2),
            "peak_adapters_per_instance": max(f.peak_loaded for f in fakes),
        }
    finally:
        await client.aclose()
        await loras.close()
        await asyncio.gather(*(f.astop() for f in fakes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2000 completions (under a minute)")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--hot", type=int, default=64)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="completions in all (default 8000, quick 2000)")
    parser.add_argument("--load-delay-ms", type=float, default=0.0)
    parser.add_argument("--think-ms", type=float, default=5.0, help="pause of each worker between completions")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 2000 if args.quick else 8000
    with tempfile.TemporaryDirectory(prefix="lineage-paging-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    for key, value in result.items():
        print(f"{key:28} {value}")
    if args.out is not None:
        args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0 if result["failed_or_wrong_adapter"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
