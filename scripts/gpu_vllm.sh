#!/usr/bin/env bash
# GPU check of the CUDA vLLM rollout (issue 21), in parts, each under its own time limit:
#
#   setup   pip install -e . --no-deps (so vLLM finds the project's plugin entry point), then what is importable:
#           vllm / fla / flashinfer versions and the entry point
#   tests   the vllm-marked tests meaningful on CUDA: test_vllm_cuda_gpu.py (plugin + FlashInfer fallbacks, sleep
#           frees memory, CUDA graphs after a reload, server mode over NCCL, MoE LoRA) and the engine, sync-equals-
#           fresh (dense tied/untied, MoE, VL text), LoRA, custom-loader and sleep-cycle files
#   grpo    GRPO through main_ppo with rollout.name=vllm, colocated (sleep mode, CUDA graphs), 3 steps on the
#           0.8B shape and 3 on the 2B shape (scripts/gpu_grpo_step.py): timings, the rollout/trainer gap every
#           step, device memory before/after the engine's sleep and the update's peak
#   bench   benchmarks/bench_rollout.py: generate vs the hf engine vs CUDA vLLM on the same prompts (B=64/256 fixed
#           lengths and the GRPO length mix), one run per shape (BENCH_SHAPES, default "0p8b 2b"), each shape on its
#           own GPU at the same time where the host has enough
#
# Logs go to $OUT/<part>.log (default ./gpu_vllm_out). Needs on the lent machine: CUDA vLLM 0.26.0 and the project
# wheels under /tmp/site (../shared/tools/gpu_wheels.sh --vllm, then .whl and .whlz, as its header says), then
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_vllm.sh
# Knobs: PARTS="setup tests grpo bench", TEST_FILES="test_vllm_cuda_gpu ..." (a subset of TESTS), T_TESTS / T_GRPO / T_BENCH (seconds), SHAPES="0p8b 2b", BENCH_ARGS.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_vllm_out}"
source scripts/gpu_parts.sh
PARTS="${PARTS:-setup tests grpo bench}"

# file:time limit in seconds (each file in its own pytest process; together under one device call)
TESTS=(test_vllm_cuda_gpu:560 test_vllm_sync_matches_fresh:110 test_vllm_rollout_lora:70 test_vllm_rollout_engine:80
       test_vllm_sleep_cycle:40 test_vllm_custom_loader:40 test_vllm_chunk_pipeline:120)

for part in $PARTS; do
    case $part in
    setup) run_part setup 120 bash -c "$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . ; \
               $PY -c 'import vllm, torch, importlib.util as u; print(\"vllm\", vllm.__version__, \"torch\", torch.__version__, torch.cuda.get_device_name(0), \"gpus\", torch.cuda.device_count()); print(\"fla\", u.find_spec(\"fla\") is not None, \"flashinfer\", u.find_spec(\"flashinfer\") is not None); from verl.workers.rollout.vllm_rollout.plugin import entry_point_installed; print(\"plugin entry point installed:\", entry_point_installed())'" ;;
    tests) # one pytest process per file: vLLM's CuMem allocator serves one sleep-mode engine per process
           # (sync_matches_fresh: the Qwen3.5 cases and server mode; the non-Qwen3.5 models are CPU-tested)
           for entry in "${TESTS[@]}"; do
               f=${entry%%:*}
               case " ${TEST_FILES:-${entry%%:*}} " in *" $f "*) ;; *) continue ;; esac
               run_part "tests_$f" "${T_TESTS:-${entry##*:}}" "$PY" -m pytest -q -s -m vllm -p no:cacheprovider \
                   -rsfE "tests/workers/rollout/$f.py" -k "not any_causal_lm"
           done ;;
    grpo)  for shape in ${SHAPES:-0p8b 2b}; do
               run_part "grpo_$shape" "${T_GRPO:-280}" "$PY" scripts/gpu_grpo_step.py --shape "$shape" --rollout vllm \
                   --steps 3 --batch 16 --n 4 --response-length 256 --workdir /tmp/verl_vllm_grpo \
                   --metrics-out "$OUT/grpo_${shape}_metrics.jsonl" \
                   actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.enforce_eager=false \
                   actor_rollout_ref.rollout.free_cache_engine=true actor_rollout_ref.actor.entropy_coeff=0.01 \
                   actor_rollout_ref.rollout.tensor_model_parallel_size=1
           done ;;
    bench) # one shape per GPU at once where the host has a GPU per shape (each run is one process on one card:
           # the engine, vLLM and generate rows of a shape share that card), else one after the other
           shapes=(${BENCH_SHAPES:-0p8b 2b})
           ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
           if (( ngpu >= ${#shapes[@]} && ${#shapes[@]} > 1 )); then
               i=0
               for shape in "${shapes[@]}"; do
                   CUDA_VISIBLE_DEVICES=$i run_part "bench_$shape" "${T_BENCH:-560}" "$PY" benchmarks/bench_rollout.py \
                       --vllm on --shape "$shape" --json "$OUT/bench_rollout_$shape.json" ${BENCH_ARGS:-} &
                   i=$((i + 1))
               done
               wait
           else
               for shape in "${shapes[@]}"; do
                   run_part "bench_$shape" "${T_BENCH:-560}" "$PY" benchmarks/bench_rollout.py --vllm on \
                       --shape "$shape" --json "$OUT/bench_rollout_$shape.json" ${BENCH_ARGS:-}
               done
           fi ;;
    *) echo "unknown part $part" ;;
    esac
done
parts_summary
exit 0
