#!/usr/bin/env bash
# Issue 23's GPU rows, each measured in one run with its baseline in the same run, plus issue 20's MoE-vs-dense
# time per token on one GPU, with profiles (top kernels, kernel classes, memory at the peak). Parts:
#
#   actor    benchmarks/bench_actor_throughput.py --impls packed_triton,megatron: the FSDP path's useful MFU against
#            the measured matmul ceiling and the datasheet; Megatron's tokens/s and memory against it (Megatron's
#            optimizer state offloaded, since the packed row holds none); each row profiled
#   moe      the same benchmark on the 35B-A3B layer shape (--layers, default 4) and its dense twin of equal
#            active parameters, both through the Megatron engine: MoE time per token / dense (issue 20: <= 1.5x)
#   sampler  benchmarks/bench_sampler.py (unfused vs fused torch vs the Triton kernel, B = 64 / 256, V = 248k)
#   rollout  benchmarks/bench_rollout.py --batches 256 --cases fixed --bf16-state: the engine vs generate, then
#            one profiled engine call (kernels of the decode steps and of the prefill)
#   actor9b  the actor benchmark's fused FSDP path on Qwen3.5-9B's shape (--layers L9B, default all 32): the update's
#            useful MFU at issue 20's size on one GPU, profiled
#   rollout9b the decode loop at the 9B shape, B = 32 and 128 (issue 20's rollout: 32 sequences per GPU), with the HBM
#            traffic per step against the time (the memory-bound floor), profiled at B = 128; prompts of 2,048 tokens
#            (the scale run's contexts: ~1k prompts + responses up to 4k); then one captured decode step with
#            1,100 tokens per slot in 5,120-token allocations, the split-K attention against the torch attention
#   tests    the correctness pins: fused sampler, fused decode step vs torch, graphs vs eager, greedy parity
#
# Logs: $OUT/<part>.log (default ./gpu_perf_out); JSON: $OUT/actor.json, $OUT/moe.json; the Chrome traces in
# $PROF (default /tmp/verl_perf_prof), packed into $OUT/traces.tar when it fits one returned file (16 MiB).
# Expects fla (with tilelang and z3) and megatron-core importable (PYTHONPATH=/tmp/site:$PWD).
# Knobs: PARTS="actor moe sampler rollout tests" (actor9b, rollout9b on request), MOE_LAYERS, L9B, T_<PART> (seconds),
# ACTOR_IMPLS / MOE_IMPLS / ACTOR9B_IMPLS;
# SMOKE=1 runs the benchmarks at their tiny shapes (on a CPU: PYTHON=.venv/bin/python SMOKE=1
# ACTOR_IMPLS=packed_torch MOE_IMPLS=packed_torch PARTS="actor moe sampler rollout" bash scripts/gpu_perf.sh).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_perf_out}"
PROF="${PROF:-/tmp/verl_perf_prof}"
source scripts/gpu_parts.sh
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
PARTS="${PARTS:-actor moe sampler rollout tests}"
mkdir -p "$PROF"
S=${SMOKE:+--smoke}

for part in $PARTS; do
    case $part in
    actor) run_part actor "${T_ACTOR:-300}" "$PY" benchmarks/bench_actor_throughput.py $S \
               --impls "${ACTOR_IMPLS:-packed_triton,megatron}" --profile "$PROF" --json "$OUT/actor.json" ;;
    moe) run_part moe "${T_MOE:-300}" "$PY" benchmarks/bench_actor_throughput.py $S \
               --impls "${MOE_IMPLS:-megatron}" --shapes 35b-a3b,35b-a3b-dense --layers "${MOE_LAYERS:-4}" \
               --no-ceiling --profile "$PROF" --json "$OUT/moe.json" ;;
    actor9b) run_part actor9b "${T_ACTOR9B:-300}" "$PY" benchmarks/bench_actor_throughput.py $S \
               --impls "${ACTOR9B_IMPLS:-packed_triton}" --shapes 9b ${L9B:+--layers "$L9B"} --profile "$PROF" \
               --json "$OUT/actor9b.json" ;;
    rollout9b) run_part rollout9b "${T_ROLLOUT9B:-300}" "$PY" benchmarks/bench_rollout.py $S \
               --shape 9b --batches 32,128 --cases fixed,step --skip-generate --vllm off --torch-attention \
               --profile "$PROF" \
               $([ -n "$S" ] || echo --prompt-len 2048 --new-tokens 512) ;;
    sampler) run_part sampler "${T_SAMPLER:-90}" "$PY" benchmarks/bench_sampler.py $S ;;
    rollout) run_part rollout "${T_ROLLOUT:-300}" "$PY" benchmarks/bench_rollout.py $S --batches 256 --cases fixed \
               --bf16-state --vllm off --profile "$PROF" ;;
    tests) run_part tests "${T_TESTS:-420}" "$PY" -m pytest -q -m gpu tests/workers/rollout/test_hf_engine_gpu.py \
               tests/workers/rollout/test_fused_sampler_gpu.py -p no:cacheprovider -rsfE ;;
    *) echo "unknown part $part" ;;
    esac
done
TAIL=60
(cd "$PROF" && ls -la && tar -cf /tmp/verl_perf_traces.tar ./*.gz 2>/dev/null) && \
    if [ "$(stat -c %s /tmp/verl_perf_traces.tar)" -le $((16 * 1048576)) ]; then
        cp /tmp/verl_perf_traces.tar "$OUT/traces.tar"
    else echo "traces ($(du -h /tmp/verl_perf_traces.tar | cut -f1)) too large to return; kept in $PROF"; fi
parts_summary
exit 0
