"""Wall time of one local-backend Training Run with the SmolLM2 recipe of docs/learning.md (issue 38 item 4), with
its phase split, optionally A/B against the trainer of another source tree, interleaved.

    .venv/bin/python bench/recipe_training_bench.py [--samples 96] [--repeats 2] [--baseline-src DIR]
    # the tree of a commit:  mkdir /tmp/base && git archive c617b54 openjiuwen | tar -x -C /tmp/base

SmolLM2-135M-Instruct (`openjiuwen-rl model smollm2`) answers the calculator family's first turn (system prompt,
two worked examples, a word problem: ~215 prompt tokens, up to 24 response tokens), sampled by the model itself at
temperature 1 with its own logprobs (cached under --cache, the drawing takes minutes on 2 cores). Each run is the
real local backend (child process) with lr 5e-4, 1 epoch, mini-batch 16, micro-batch 4, KL and entropy off,
`detach_prompt`, 1 trainer thread. `--baseline-src` runs the worker module from that tree instead of this one
(the same Python and packages), alternating with this tree's. Prints a table; writes bench/results/recipe-training.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingJob  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402

SMOLLM2 = Path.home() / ".cache" / "openjiuwen-rl" / "models" / "smollm2-135m-instruct"
# docs/learning.md "What changed in the trainer": the calculator demo's ppo.yaml (demo/stack_config.py).
RECIPE = PPOSettings(learning_rate=5e-4, ppo_epochs=1, ppo_mini_batch_size=16, ppo_micro_batch_size=4,
                     use_kl_in_reward=False, kl_coef=0.0, entropy_coeff=0.0, detach_prompt=True, num_threads=1,
                     max_prompt_length=512, max_response_length=64)
# The worker of another tree: this Python, that tree first on the path, the editable install's finder removed (it
# would resolve `openjiuwen` to this worktree whatever the path says).
LAUNCHER = """import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path.insert(0, sys.argv[1])
module = sys.argv[3]
sys.argv = [module] + sys.argv[4:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def samples(model_dir: Path, count: int, max_tokens: int, cache: Path | None) -> list[dict[str, Any]]:
    from bench.training_samples import calculator_samples

    if cache is None:
        return calculator_samples(model_dir, count, seed=0, max_tokens=max_tokens)
    path = cache / f"calculator-{model_dir.name}-{count}x{max_tokens}-seed0.json"
    if path.exists():
        return orjson.loads(path.read_bytes())
    docs = calculator_samples(model_dir, count, seed=0, max_tokens=max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(docs))
    return docs


def worker_python(tmp: Path, src: Path | None) -> str:
    """The `python` a LocalBackend starts its worker with: this interpreter, or a wrapper running `src`'s worker."""
    if src is None:
        return sys.executable
    launcher = tmp / "launch_from.py"
    launcher.write_text(LAUNCHER, encoding="utf-8")
    wrapper = tmp / "python-from-src"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{launcher}" "{src.resolve()}" "$@"\n', encoding="utf-8")
    wrapper.chmod(0o700)
    return str(wrapper)


async def one_run(arm: str, python: str, model_dir: Path, docs: list[dict[str, Any]], tmp: Path, n: int,
                  settings: PPOSettings) -> dict[str, Any]:
    backend = LocalBackend(LoraRepository(tmp / f"loras-{arm}-{n}", model_id="bench"), settings=settings,
                           tmp_root=tmp / "train", python=python)

    async def ignore(_: dict) -> None:
        return None

    load = os.getloadavg()[0]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker's CPU: less at the mercy of other work than wall
    started = time.perf_counter()
    artifact = await backend.train(TrainingJob(training_run_id=f"run-{n:012x}", model_id="bench",
                                               base_model_path=str(model_dir), samples=docs, init_lora_name="base",
                                               init_lora_path=""), on_progress=ignore)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    meta = artifact.metadata
    return {"arm": arm, "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu_s, 2), "load_avg_at_start": load,
            "timings": meta.get("timings"), "ppo_seconds": sum(s["seconds"] for s in meta["ppo_step_metrics"]),
            "recomputed_samples": (meta.get("sampling") or {}).get("recomputed_samples")}


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    if args.model_dir == "tiny":  # the smoke run's: a tiny random model, its samples drawn afresh
        from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model

        model_dir, cache = make_tiny_model(tmp / "tiny", seed=0), None
    else:
        model_dir, cache = Path(args.model_dir), Path(args.cache)
    docs = samples(model_dir, args.samples, args.max_tokens, cache)
    settings = RECIPE
    (tmp / "train").mkdir(mode=0o700)
    arms = [("this tree", worker_python(tmp, None))]
    if args.baseline_src:
        arms.append(("baseline", worker_python(tmp, Path(args.baseline_src))))
    runs = []
    for r in range(args.repeats):
        order = arms if r % 2 == 0 else arms[::-1]  # alternate which arm goes first
        for arm, python in order:
            runs.append(await one_run(arm, python, model_dir, docs, tmp, len(runs), settings))
            last = runs[-1]
            print(f"  {arm}: wall {last['wall_seconds']:.1f} s, cpu {last['cpu_seconds']:.1f} s, load "
                  f"{last['load_avg_at_start']:.1f} {last['timings'] or ''}", flush=True)
    summary = {}
    for arm, _ in arms:
        mine = [x for x in runs if x["arm"] == arm]
        summary[arm] = {"median_wall_seconds": statistics.median(x["wall_seconds"] for x in mine),
                        "median_cpu_seconds": statistics.median(x["cpu_seconds"] for x in mine),
                        "walls": [x["wall_seconds"] for x in mine], "cpus": [x["cpu_seconds"] for x in mine]}
    return {"samples": len(docs), "model": model_dir.name, "settings": settings.to_dict(),
            "baseline_src": args.baseline_src, "runs": runs, "summary": summary, "machine": machine_facts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(SMOLLM2), help="a Hugging Face directory, or `tiny` (smoke runs)")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm (interleaved)")
    parser.add_argument("--baseline-src", default=None, help="a source tree whose `openjiuwen` trainer is the A arm")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "openjiuwen-rl" / "bench"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "recipe-training.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-recipe-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    out = write_result(result, args.out)
    print(f"local backend, {result['model']}, {result['samples']} samples, SmolLM2 recipe; "
          f"load average at the end {result['machine']['load_avg']}")
    for arm, s in result["summary"].items():
        print(f"  {arm:>10}: median wall {s['median_wall_seconds']:.1f} s {s['walls']}, "
              f"median worker cpu {s['median_cpu_seconds']:.1f} s {s['cpus']}")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
