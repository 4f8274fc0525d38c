#!/usr/bin/env bash
# Real-size Qwen3.5 GRPO on one host of several GPUs (issue 20), in parts, each under its own time limit:
#
#   versions  torch / megatron-core / fla / ray / transformers, and the GPUs seen
#   mcore     pytest tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py: the mcore model at TP=2 (+SP) and EP=2
#             against Hugging Face (log-probs on the GPU; gradients, A_log's included, against an fp64 torch
#             reference on the CPU), needs 2 GPUs
#   fsdp      scripts/gpu_scale.py fsdp: Qwen3.5-9B shape on FSDP2 over all GPUs, 3 GRPO steps + save, then a
#             resumed step 4 (built-in rollout, EOS-calibrated long-tailed responses <= 4k, prompts ~1k, n=8)
#   megatron  scripts/gpu_scale.py megatron: the 35B-A3B shape with MOE_LAYERS of its 40 layers on Megatron,
#             EP=all GPUs, then TP=2 x EP=GPUs/2 (where the host has 4)
#
# Needs the wheels of ../shared/tools/gpu_wheels.sh --ray installed (fla, megatron-core, Hydra, tensordict, Ray):
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_scale.sh
# Where one call may last only minutes (the device tool: 10), run one part and stage per call, e.g.
#   PARTS=fsdp SCALE_ARGS="--stage build" bash scripts/gpu_scale.sh, then --stage train, then --stage resume.
# Knobs: PARTS="versions mcore fsdp megatron", T_MCORE / T_FSDP / T_MEGATRON (seconds per part), GPUS (default: all),
# MOE_LAYERS (default 12 on 2 GPUs, 24 on 4: what the distributed optimizer fits without offload, see docs),
# OFFLOAD=1 (optimizer offload for both), SCALE_ARGS (more gpu_scale.py arguments). Logs: $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_scale_out}"
source scripts/gpu_parts.sh
PARTS="${PARTS:-versions mcore fsdp megatron}"
GPUS="${GPUS:-$($PY -c 'import torch; print(torch.cuda.device_count())')}"
MOE_LAYERS="${MOE_LAYERS:-$(( GPUS >= 4 ? 24 : 12 ))}"
OFF=${OFFLOAD:+--offload}

for p in $PARTS; do
    case $p in
    versions) PARTS=versions OUT="$OUT" bash scripts/gpu_multi.sh ;;  # the same versions report
    mcore) run_part mcore "${T_MCORE:-600}" "$PY" -m pytest -v -s -m gpu -p no:cacheprovider -rsfE \
               tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py ;;
    fsdp) run_part fsdp "${T_FSDP:-3000}" "$PY" scripts/gpu_scale.py fsdp --gpus "$GPUS" $OFF ${SCALE_ARGS:-} ;;
    megatron)
        run_part "megatron_ep$GPUS" "${T_MEGATRON:-3000}" "$PY" scripts/gpu_scale.py megatron --gpus "$GPUS" \
            --ep "$GPUS" --layers "$MOE_LAYERS" $OFF ${SCALE_ARGS:-}
        if [ "$GPUS" -ge 4 ]; then
            run_part megatron_tp2 "${T_MEGATRON:-3000}" "$PY" scripts/gpu_scale.py megatron --gpus "$GPUS" \
                --tp 2 --ep $(( GPUS / 2 )) --layers "$MOE_LAYERS" $OFF ${SCALE_ARGS:-}
        fi ;;
    *) echo "unknown part $p" ;;
    esac
done
parts_summary
exit 0
