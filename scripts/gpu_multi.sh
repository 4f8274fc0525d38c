#!/usr/bin/env bash
# The several-GPU check (issue 15) in one command, for a host with 2 GPUs (nvidia-h200-x2 or larger) and Ray:
#
#   versions  torch / megatron-core / fla / ray, and the GPUs seen
#   fsdp      scripts/gpu_multi.py fsdp      FSDP2 GRPO: the demo's first step on 1 vs 2 GPUs through Ray (same
#                                            greedy batch), pg_loss / grad_norm / entropy within bf16 noise,
#                                            tokens/s per GPU of each layout
#   mcore     pytest tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py   the mcore Qwen3.5 model's packed
#                                            log-probs and gradients at TP=2 (with and without SP) and EP=2 vs HF
#   megatron  scripts/gpu_multi.py megatron  3 GRPO steps each at TP=2 (dense), EP=2 (MoE), PP=2 (dense) through
#                                            main_ppo --config-name ppo_megatron_trainer, and PP=2 EP=2 (MoE) on 4
#                                            GPUs (skipped with a line on a 2-GPU host); every step's weight sync
#                                            into the hf rollout runs its coverage check
#
# NCCL multicast is left as the machine's environment sets it (off on the lent hosts); nothing here changes it.
# Needs the wheels of ../shared/tools/gpu_wheels.sh --ray installed (fla, megatron-core, Hydra, tensordict, Ray):
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_multi.sh
# Knobs: PARTS="versions fsdp mcore megatron", T_FSDP / T_MCORE / T_MEGATRON (seconds per part),
# MEGATRON_CASES="tp2 ep2 pp2 pp2ep2" (a subset, to fit the device tool's per-call time limit). Logs: $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_multi_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" ;; esac
PY="${PYTHON:-python3}"
PARTS="${PARTS:-versions fsdp mcore megatron}"
declare -A RC

part() {  # name, limit, command...
    local name=$1 limit=$2; shift 2
    echo "################ [$name] $(date -u +%H:%M:%S) limit ${limit}s: $*"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    RC[$name]=$?
    tail -n 25 "$OUT/$name.log"
    echo "################ [$name] exit ${RC[$name]}"
}

for p in $PARTS; do
    case $p in
    versions) part versions 60 "$PY" -c "
import importlib, torch
print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for m in ('megatron.core', 'fla', 'ray', 'transformers'):
    try:
        print(m, getattr(importlib.import_module(m), '__version__', '?'))
    except Exception as e:
        print(m, 'NOT importable:', e)" ;;
    fsdp) part fsdp "${T_FSDP:-600}" "$PY" scripts/gpu_multi.py fsdp ;;
    mcore) part mcore "${T_MCORE:-600}" "$PY" -m pytest -v -m gpu -s tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py \
        -p no:cacheprovider -rsfE ;;
    megatron) part megatron "${T_MEGATRON:-1800}" "$PY" scripts/gpu_multi.py megatron ${MEGATRON_CASES:+--cases $MEGATRON_CASES} ;;
    *) echo "unknown part $p" ;;
    esac
done
echo "================ SUMMARY"
for p in $PARTS; do [ -n "${RC[$p]+x}" ] && echo "| $p | exit ${RC[$p]} |"; done
exit 0
