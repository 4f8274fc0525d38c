#!/usr/bin/env bash
# GPU check of the hf rollout engine (issue 14), in parts, each under its own time limit:
#
#   tests   pytest -m gpu tests/workers/rollout/test_hf_engine_gpu.py  (fla in-place recurrent step vs the
#           torch reference, CUDA-graph replay vs eager, greedy parity with generate in fp32, torch varlen
#           attention vs padded SDPA); tests/workers/rollout/test_fused_sampler_gpu.py (the fused sampler's
#           Triton kernel vs its torch path, its distribution, CUDA-graph replay);
#           tests/workers/rollout/test_hf_engine_speculative_gpu.py (MTP speculative decoding = plain, on CUDA)
#   bench   benchmarks/bench_rollout.py  (engine vs model.generate: 0.8B shape, B=64/256, 256+512 tokens;
#           GRPO-like length mix with continuous vs static batching)
#   sampler benchmarks/bench_sampler.py  (the decode sampler over a 248k vocabulary: unfused vs fused torch vs
#           the Triton kernel, B=64/256)
#   grpo    scripts/gpu_grpo_step.py     (one GRPO step with the hf engine: generation's share of the step)
#   actor   benchmarks/bench_actor_throughput.py --impls packed_triton@sdpa,packed_triton@torch_varlen
#
# Logs go to $OUT/<part>.log (default ./gpu_rollout_out). Expects fla etc. importable: on the lent machine install
# BOTH wheel folders (.whlz with z3 first, then .whl; without z3 tilelang fails to import and fla with it), then
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_rollout.sh
# Knobs: PARTS="tests bench sampler grpo actor", T_TESTS / T_BENCH / T_SAMPLER / T_GRPO / T_ACTOR (seconds), BENCH_ARGS.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_rollout_out}"
source scripts/gpu_parts.sh
PARTS="${PARTS:-tests bench sampler grpo actor}"

for part in $PARTS; do
    case $part in
    tests) run_part tests "${T_TESTS:-240}" "$PY" -m pytest -q -m gpu tests/workers/rollout/test_hf_engine_gpu.py \
               tests/workers/rollout/test_fused_sampler_gpu.py tests/workers/rollout/test_hf_engine_speculative_gpu.py \
               -p no:cacheprovider -rsfE ;;
    bench) run_part bench "${T_BENCH:-360}" "$PY" benchmarks/bench_rollout.py --json "$OUT/bench_rollout.json" \
               ${BENCH_ARGS:-} ;;
    sampler) run_part sampler "${T_SAMPLER:-120}" "$PY" benchmarks/bench_sampler.py ;;
    grpo)  run_part grpo "${T_GRPO:-240}" "$PY" scripts/gpu_grpo_step.py --workdir /tmp/verl_rollout_grpo \
               --metrics-out "$OUT/grpo_metrics.jsonl" ;;
    actor) run_part actor "${T_ACTOR:-200}" "$PY" benchmarks/bench_actor_throughput.py \
               --impls packed_triton@sdpa,packed_triton@torch_varlen --warmup 1 --repeat 3 --no-ceiling \
               --json "$OUT/actor.json" ;;
    *) echo "unknown part $part" ;;
    esac
done
parts_summary
exit 0
