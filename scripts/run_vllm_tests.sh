#!/usr/bin/env bash
# Runs the vllm-marked tests in the isolated .venv-vllm (built by scripts/setup_vllm_env.sh).
#   bash scripts/run_vllm_tests.sh                       # every vllm-marked test under tests/
#   bash scripts/run_vllm_tests.sh tests/workers/rollout/ # one folder
#   bash scripts/run_vllm_tests.sh -k lora               # extra pytest args pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "no vLLM test env at $VENV; run: bash scripts/setup_vllm_env.sh" >&2
    exit 2
fi
# In-process engine (the weight sync streams through a Python iterator) and a small CPU KV cache (GiB).
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export TOKENIZERS_PARALLELISM=false
cd "$ROOT"
if [[ $# -eq 0 ]]; then
    set -- tests/  # the marker selects: a vllm test added in any folder runs without editing this script
fi
exec "$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -q "$@"
