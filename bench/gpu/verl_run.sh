#!/usr/bin/env bash
# GPU check of the verl backend: one full Training Run through the RL Service on one GPU (claim, verl PPO in a Ray
# actor with FSDP, PEFT export, repository publish, activation on a fake gateway), with a locally generated
# Qwen2-architecture model of about 0.3 B parameters. Prints wall time, tokens/s and the learning margin, and writes
# bench/results/verl_gpu.json. Fits in 10 minutes (a hard `timeout` of 570 s guards the run).
#
#   bench/gpu/verl_run.sh             set up .venv-gpu from a wheel folder (no internet needed), then run
#   bench/gpu/verl_run.sh --check     set up and only report the environment (python, torch, CUDA, packages)
#   bench/gpu/verl_run.sh --dry-run   the same run CPU-sized (tiny model) in the project's .venv, no GPU needed
#
# What the GPU machine needs (see docs/training.md, "GPU check"):
#   - Python 3.12 (PYTHON, default python3.12), an NVIDIA GPU with its driver (nvidia-smi), and torch with CUDA
#     either installed for that Python (the venv sees system site-packages) or as a wheel in the wheel folder;
#   - a redis-server binary on PATH (or in REDIS_BIN_DIR);
#   - the wheel folder WHEELS (default bench/gpu/wheels) holding, for cp312 / manylinux x86_64, every package of
#     requirements.lock except torch, and verl from requirements-nodeps.lock. Fill it on a connected machine:
#       grep -v '^torch==' requirements.lock > /tmp/req-gpu.txt
#       pip download -d bench/gpu/wheels --python-version 3.12 --platform manylinux2014_x86_64 \
#           --platform manylinux_2_28_x86_64 --only-binary=:all: -r /tmp/req-gpu.txt
#       pip download -d bench/gpu/wheels --no-deps --python-version 3.12 --only-binary=:all: -r requirements-nodeps.lock
#     (and a CUDA torch wheel, e.g. torch==2.13.0 from the PyTorch CUDA index, if the machine has none).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE=run
case "${1:-}" in
    "") ;;
    --check) MODE=check ;;
    --dry-run) MODE=dry-run ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--check | --dry-run | --help]" >&2; exit 2 ;;
esac

export RAY_AUTH_MODE=disabled          # Ray 2.60 would switch token authentication on and write ~/.ray/auth_token
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the Ray workers import the project from here
if [ -n "${REDIS_BIN_DIR:-}" ]; then export PATH="$REDIS_BIN_DIR:$PATH"; fi
mkdir -p "$ROOT/bench/results"

if [ "$MODE" = dry-run ]; then
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || { echo "error: $PY missing: run 'make venv' first" >&2; exit 1; }
    exec timeout 570 "$PY" "$ROOT/bench/gpu/verl_run.py" --size cpu --device cpu \
        --out "$ROOT/bench/results/verl_cpu.json"
fi

PYTHON="${PYTHON:-python3.12}"
VENV="${VENV:-$ROOT/.venv-gpu}"
WHEELS="${WHEELS:-$ROOT/bench/gpu/wheels}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "error: no NVIDIA GPU visible (nvidia-smi)" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "error: redis-server not on PATH (set REDIS_BIN_DIR)" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --quiet --no-index --find-links "$WHEELS")
if ! "$VPY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "torch with CUDA not found for $PYTHON: installing torch from $WHEELS"
    "${PIP[@]}" torch
fi
# The CPU pin of torch stays out: this machine's CUDA build is the one to use.
grep -v '^torch==' "$ROOT/requirements.lock" > "$VENV/requirements-gpu.txt"
"${PIP[@]}" -r "$VENV/requirements-gpu.txt"
"${PIP[@]}" --no-deps -r "$ROOT/requirements-nodeps.lock"

"$VPY" - <<'EOF'
import importlib.metadata as md, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"gpus {torch.cuda.device_count()} ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'})")
for name in ("verl", "ray", "transformers", "peft", "tensordict", "hydra-core", "datasets", "fastapi", "redis"):
    print(f"  {name} {md.version(name)}")
EOF
[ "$MODE" = check ] && exit 0

exec timeout 570 "$VPY" "$ROOT/bench/gpu/verl_run.py" --size gpu --out "$ROOT/bench/results/verl_gpu.json"
