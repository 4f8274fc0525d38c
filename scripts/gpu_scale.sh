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
#             EP=all GPUs, then its dense twin (same active parameters per token, data parallel), then TP=2 x
#             EP=GPUs/2: the update's microseconds per token side by side
#
# Needs the wheels of ../shared/tools/gpu_wheels.sh --ray installed (fla, megatron-core, Hydra, tensordict, Ray):
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_scale.sh
# Where one call may last only minutes (the device tool: 10), run one part and stage per call, e.g.
#   PARTS=fsdp STAGE=build bash scripts/gpu_scale.sh, then STAGE=train, then STAGE=resume,
# or the whole thing in a session of its own that outlives the call, waited for by the calls after it:
#   bash scripts/gpu_detached.sh start scale bash scripts/gpu_scale.sh
#   then, one call each until it stops answering 124: bash scripts/gpu_detached.sh wait scale 560
# Knobs: PARTS="versions mcore fsdp megatron", T_MCORE / T_FSDP / T_MEGATRON (seconds per part), GPUS (default: all),
# MCORE_K (a pytest -k expression for the mcore part, e.g. moe), MOE_TP2=0 (the megatron part without TP 2 x EP),
# MOE_TWIN=0 (without the dense twin), EP_ARGS / TWIN_ARGS (gpu_scale.py arguments for the EP case / the twin
# alone, e.g. a profile),
# MOE_LAYERS (default: 2 per GPU on 80 GB cards, 4 per GPU on larger ones: what fits beside the hf rollout's
# full copy, see docs/advance/scale.md), OFFLOAD (optimizer offload; default 1 on 80 GB cards, where the 9B
# update without it ran out of memory), SCALE_ARGS (more gpu_scale.py arguments; the defaults below are the
# workload measured on 4 x H100 on 2026-11-26: 16 prompts x n=8, 3 steps, micro-batches of one max sequence). Logs: $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_scale_out}"
source scripts/gpu_parts.sh
PARTS="${PARTS:-versions mcore fsdp megatron}"
GPUS="${GPUS:-$($PY -c 'import torch; print(torch.cuda.device_count())')}"
GIB="$($PY -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')"
MOE_LAYERS="${MOE_LAYERS:-$(( GPUS * (GIB < 100 ? 2 : 4) ))}"
OFFLOAD="${OFFLOAD:-$(( GIB < 100 ? 1 : 0 ))}"
OFF=$([ "$OFFLOAD" = 1 ] && echo --offload)
SCALE_ARGS="${SCALE_ARGS:---prompts 16 --steps 3 --update-tokens 1.0} ${STAGE:+--stage $STAGE}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

for p in $PARTS; do
    case $p in
    versions) PARTS=versions OUT="$OUT" bash scripts/gpu_multi.sh ;;  # the same versions report
    mcore) run_part mcore "${T_MCORE:-600}" "$PY" -m pytest -v -s -m gpu -p no:cacheprovider -rsfE \
               ${MCORE_K:+-k "$MCORE_K"} tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py ;;
    fsdp) run_part fsdp "${T_FSDP:-3000}" "$PY" scripts/gpu_scale.py fsdp --gpus "$GPUS" $OFF ${SCALE_ARGS:-} ;;
    megatron)
        run_part "megatron_ep$GPUS" "${T_MEGATRON:-3000}" "$PY" scripts/gpu_scale.py megatron --gpus "$GPUS" \
            --ep "$GPUS" --layers "$MOE_LAYERS" $OFF ${SCALE_ARGS:-} ${EP_ARGS:-}
        # the other layouts are measured for their steps only (one launch, no save): the save and resume at
        # this shape are EP's
        only_steps=$([ "${STAGE:-}" = build ] || echo --stage train --no-save)
        if [ "${MOE_TWIN:-1}" = 1 ]; then  # the dense twin: the baseline of the update's time per token
            run_part megatron_dense_twin "${T_MEGATRON:-3000}" "$PY" scripts/gpu_scale.py megatron --gpus "$GPUS" \
                --dense-twin --layers "$MOE_LAYERS" $OFF ${SCALE_ARGS:-} $only_steps ${TWIN_ARGS:-}
        fi
        if [ "$GPUS" -ge 2 ] && [ "${MOE_TP2:-1}" = 1 ]; then  # on 2 GPUs: TP 2 x EP 1 (experts split by ETP)
            run_part megatron_tp2 "${T_MEGATRON:-3000}" "$PY" scripts/gpu_scale.py megatron --gpus "$GPUS" \
                --tp 2 --ep $(( GPUS / 2 )) --layers "$MOE_LAYERS" $OFF ${SCALE_ARGS:-} $only_steps
        fi ;;
    *) echo "unknown part $p" ;;
    esac
done
parts_summary
exit 0
