"""bench/gpu/local_multi.py, CPU-sized (`--quick`): the script the GPU machine runs with torch, transformers and peft
only. Run here with verl, Ray and this project made unimportable, so an import of any of them anywhere in its chain
fails this test; the result must show each lineage's adapter trained in turns equal to the one trained alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "local_multi.py"
# `sys.modules[name] = None` makes every later `import name` (or of a submodule) raise ImportError.
HIDDEN = ("verl", "ray", "openjiuwen", "tests", "bench")
RUNNER = ("import runpy, sys\n"
          f"for name in {HIDDEN!r}:\n"
          "    sys.modules[name] = None\n"
          "sys.path = [p for p in sys.path if p not in ('', {root!r})]\n"
          "sys.argv = [{script!r}] + sys.argv[1:]\n"
          "runpy.run_path({script!r}, run_name='__main__')\n")


def test_the_cpu_size_runs_without_verl_ray_or_the_project(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    code = RUNNER.format(root=str(ROOT), script=str(SCRIPT))
    out = subprocess.run([sys.executable, "-c", code, str(model), "--device", "cpu", "--quick"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env={
                             "PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one after another: total" in out.stdout and "interleaved: total" in out.stdout
    result = json.loads((tmp_path / "out" / "local_multi_tiny_k2.json").read_text())
    assert [r["lineage"] for r in result["sequential"]["runs"]] == [0, 1]
    assert [r["lineage"] for r in result["interleaved"]["runs"]] == [0, 1]
    assert result["sequential"]["total_seconds"] > 0 and result["interleaved"]["total_seconds"] > 0
    # Same seeds, same batches, same order of operations per lineage on the CPU: equal to the last bit.
    assert result["max_abs_diff_interleaved_vs_alone"] == [0.0, 0.0]
    assert result["max_abs_diff_between_lineages"] > 1e-3  # and the two lineages did train apart


def test_it_refuses_a_directory_without_a_model_and_wants_one_source(tmp_path: Path) -> None:
    for argv, message in (([str(tmp_path)], "holds no config.json"), ([], "name either MODEL_DIR or --random-model"),
                          ([str(tmp_path), "--random-model", "tiny"], "name either")):
        out = subprocess.run([sys.executable, str(SCRIPT), *argv, "--device", "cpu"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, argv


def test_the_random_models_have_their_sizes(tmp_path: Path) -> None:
    """`--random-model`: what the GPU machine trains when no model directory is carried to it. The tiny one is
    generated here; the 0.4 B one is counted on the meta device (the GPU check's 0.37 B shape, a 32k vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from bench.gpu import local_multi

    tiny = local_multi.random_model("tiny", tmp_path / "tiny")
    assert AutoConfig.from_pretrained(tiny).vocab_size == 384
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny).parameters()) < 1e6
    with torch.device("meta"):
        big = Qwen2ForCausalLM(Qwen2Config(**local_multi.RANDOM_MODELS["0.4b"], tie_word_embeddings=True))
    assert 3e8 < sum(p.numel() for p in big.parameters()) < 5e8
