#!/usr/bin/env bash
# The 35B-A3B measurement launch on one host of 4 GPUs (or 2, where only 2 are lent; issue 20), everything in one
# detached session:
#   1. side by side: the MoE checkpoint build, its dense twin's, the Megatron engine's GPU tests (train steps,
#      export, offload, resume of tiny dense and MoE models: the grouped experts' main_grad accumulation and the
#      export's expert runs, changed since their last run; GPU 0), the hf engine's GPU tests not run since the
#      decode attention kernel and the MoE decode benchmark with a profile (GPU 2 of 4, GPU 0 of 2);
#   2. gpu_scale.sh's megatron part: EP = all GPUs and the dense twin (MOE_TP2=1: then TP 2 x EP GPUs/2), steps
#      1-2 each without a save, at PROMPTS prompts x n=8 (default 32 per GPU: 256 of the rollout's slots per
#      GPU, the 9B's batch where its generation share met the goal; at 128 slots per GPU the MoE's was 36-44 % on
#      2 x H200, 2026-11-28, its log-normal tail leaving ~30 slots live; 32 % at 256 slots per GPU on 2 x H100,
#      4 layers, OFFLOAD=0, the same day: ~800 s for the whole launch).
# Layers: 4 per GPU on cards over 100 GB (16 on 4 GPUs: the experts per GPU of 16 layers at EP 4), else 2 per GPU
# (with optimizer offload, gpu_scale.sh's default there).
#   export PYTHONPATH=/tmp/site:$PWD
#   bash scripts/gpu_detached.sh start moe bash scripts/gpu_scale_moe.sh
#   bash scripts/gpu_detached.sh wait moe 560     # one call each, back to back, until it stops answering 124
# Logs: $OUT (default /tmp/moe_out; gpu_detached.sh starts it without the device call's OUT, a folder emptied at
# every call), checkpoints, metrics and traces: /tmp/verl_scale.
# Knobs for the side-by-side part: MEGATRON_K (a pytest -k for the engine tests), PARITY_K (a -k for the mcore
# parity test on GPUs 0-1, e.g. moe-tp1-ep2: the grouped experts' gradients against an fp64 reference; off by
# default), HF_TESTS (the hf engine tests and the decode benchmark; default on with more than 2 GPUs), T_TESTS.
# PROFILE=1: EP's and the twin's step 3 profiled as well (device events of rank 0's old log-prob and update, one
# trace each; the trace's export runs inside the profiled call, so steps 1-2 stay the measured ones).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/moe_out}"
PY="${PYTHON:-python3}"
N=$(nvidia-smi -L | wc -l)
PROMPTS="${PROMPTS:-$(( 32 * N ))}"
mkdir -p "$OUT"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
L=$(( N * (MIB < 100000 ? 2 : 4) ))
echo "layers $L (card $MIB MiB, $N GPUs), prompts $PROMPTS"
nvidia-smi -L
build() {  # GPU, extra gpu_scale.py arguments
    local gpu=$1; shift
    CUDA_VISIBLE_DEVICES=$gpu "$PY" scripts/gpu_scale.py megatron --gpus "$N" --layers "$L" --prompts "$PROMPTS" \
        --stage build "$@"
}
(build $(( N - 1 )) --ep "$N" > "$OUT/build_moe.log" 2>&1; echo "build moe: exit $?") &
(build $(( 1 % N )) --dense-twin > "$OUT/build_twin.log" 2>&1; echo "build twin: exit $?") &
(CUDA_VISIBLE_DEVICES=0 timeout "${T_TESTS:-330}" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rsfE \
    tests/workers/engine/test_megatron_qwen35_gpu.py ${MEGATRON_K:+-k "$MEGATRON_K"} \
    > "$OUT/megatron_tests.log" 2>&1; echo "megatron engine tests: exit $?"; tail -3 "$OUT/megatron_tests.log") &
# the mcore MoE layer against HF and the fp64 reference (gradients through the grouped experts), GPUs 0-1
if [ -n "${PARITY_K:-}" ]; then
    (CUDA_VISIBLE_DEVICES=0,1 timeout "${T_TESTS:-330}" "$PY" -m pytest -q -s -m gpu -p no:cacheprovider -rsfE \
        tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py -k "$PARITY_K" \
        > "$OUT/mcore_parity.log" 2>&1; echo "mcore parity ($PARITY_K): exit $?"; tail -3 "$OUT/mcore_parity.log") &
fi
# HF_TESTS=0 (the default on 2 GPUs, where they would share GPU 0 with the tests above and outlast the builds)
if [ "${HF_TESTS:-$(( N > 2 ))}" = 1 ]; then
(CUDA_VISIBLE_DEVICES=$(( 2 % N )) timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    -rsfE tests/workers/rollout/test_hf_engine_gpu.py -k "greedy or varlen or session or cuda_graph" \
    > "$OUT/hf_engine_tests.log" 2>&1; echo "hf engine tests: exit $?"; tail -3 "$OUT/hf_engine_tests.log"
 # the MoE decode step on its own (7.0 ms at 32 slots in the 16-prompt run, 4 x H200, 2026-11-27): bytes per
 # step against the time, and the kernels of a profiled decode call
 CUDA_VISIBLE_DEVICES=$(( 2 % N )) timeout 150 "$PY" benchmarks/bench_rollout.py --shape 35b-a3b --layers "$L" \
    --batches 32,128 --cases fixed --skip-generate --vllm off --prompt-len 1024 --new-tokens 512 \
    --profile /tmp/moe_prof > "$OUT/moe_decode.log" 2>&1; echo "moe decode bench: exit $?") &
fi
wait
echo "=== side-by-side part done at $(date -u +%T)"
[ -f "$OUT/moe_decode.log" ] && grep -v '^\[transformers\]' "$OUT/moe_decode.log" | tail -40
# --gpu-mem 0.9: with the optimizer on the GPU and the hf copy, 0.85 leaves room for barely 128 slots at 16 layers.
# TORCH_LOGS=recompiles: whether torch.compile'd functions (megatron-core's jit_fuser) recompile; none did on
# 2026-11-28 (2 x H200), when step 1's MoE update still took ~100 s more than step 2's.
export TORCH_LOGS="${TORCH_LOGS:-recompiles}"
STEPS=3 PROF=""
if [ "${PROFILE:-0}" = 1 ]; then STEPS=4 PROF="--profile 3 --profile-tasks"; fi
OUT="$OUT" MOE_LAYERS=$L PARTS=megatron STAGE=train EP_ARGS="$PROF" TWIN_ARGS="$PROF" MOE_TP2="${MOE_TP2:-0}" \
    SCALE_ARGS="--prompts $PROMPTS --steps $STEPS --update-tokens 2.0 --no-save --gpu-mem 0.9" bash scripts/gpu_scale.sh
