#!/usr/bin/env bash
# The whole GPU check of this project in one command, for the lent H100/H200 (or any CUDA machine):
#
#   1. nvidia-smi and the versions of torch / transformers / triton / fla / tilelang
#   2. pytest -m gpu tests/           (bf16 parity of the fla / flash-attn / triton paths, FSDP2 offload)
#   3. scripts/gpu_grpo_step.py       (warm-up + 1 GRPO step of a Qwen3.5-0.8B-shaped model, hf rollout,
#                                      in-process launcher; timing breakdown from the file logger)
#   4. benchmarks/bench_actor_throughput.py  ((a) packed vs stock padded useful tokens/s, (c) MFU)
#   5. benchmarks/bench_logprob.py    ((b) fused log-prob + entropy: peak memory and time)
#   6. the issue scripts, each with its own parts and limits, logs under $OUT/<part>/:
#        megatron  scripts/gpu_megatron.sh  (Megatron engine: GPU tests, 3-step GRPO + resume, parity with FSDP,
#                                            throughput row)
#        sft       scripts/gpu_sft.sh       (5 SFT steps, Megatron vs FSDP, bf16 noise measured in the run)
#        rollout   scripts/gpu_rollout.sh   (hf engine GPU tests, engine vs generate benchmark, GRPO step)
#   7. a summary: each part's exit code and time, then every result table again
#
# The device tool limits each call's time: run the parts in groups, e.g.
#   SUITE_PARTS="smi pytest grpo actor logprob"; SUITE_PARTS=megatron; SUITE_PARTS="sft rollout"
#
# Each part runs under its own time limit and a failure never stops the next one. Everything is tee'd into
# $OUT/gpu_suite.log (default ./gpu_suite_out/ when OUT is unset), each part also into its own log.
# Expects fla, tilelang, omegaconf, ... importable (on the lent machine: the wheels of
# /work/shared/tools/gpu_wheels.sh installed into /tmp/site), e.g.
#
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_suite.sh
#
# Knobs (environment): SUITE_PARTS="smi pytest grpo actor logprob" (subset/order), SUITE_SMOKE=1 (tiny
# shapes, for a CPU dry run of the plumbing), T_PYTEST / T_GRPO / T_ACTOR / T_LOGPROB (seconds per part).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_suite_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_suite.log"
: > "$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" ;; esac
PY="${PYTHON:-python3}"
# pytest last: the benchmarks compile and autotune the fla/Triton kernels first (cold compiles stalled it once)
PARTS="${SUITE_PARTS:-smi grpo actor logprob pytest megatron sft rollout}"
SMOKE="${SUITE_SMOKE:-0}"
SUITE_START=$SECONDS
declare -A RC SECS

say() { echo "$*" | tee -a "$LOG"; }

# run_part NAME LIMIT_S CMD...: runs CMD with a time limit, output to $OUT/NAME.log and the suite log.
run_part() {
    local name=$1 limit=$2; shift 2
    say ""
    say "################ [$name] $(date -u +%H:%M:%S) limit ${limit}s: $*"
    local t0=$SECONDS
    set -o pipefail
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tee -a "$LOG" >/dev/null
    local rc=$?
    set +o pipefail
    RC[$name]=$rc
    SECS[$name]=$((SECONDS - t0))
    # the part's own output, condensed, so the reply's tail still shows progress
    tail -n 5 "$OUT/$name.log"
    say "################ [$name] exit $rc after ${SECS[$name]}s$([ "$rc" = 124 ] && echo ' (TIME LIMIT)')"
}

for part in $PARTS; do
    case $part in
    smi)
        run_part smi 60 bash -c "nvidia-smi || echo 'nvidia-smi not available'; $PY - <<'EOF'
import importlib, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
for m in ('transformers', 'triton', 'fla', 'tilelang', 'flash_attn', 'omegaconf', 'peft'):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, '__version__', '?'))
    except Exception as e:
        print(m, 'NOT importable:', type(e).__name__, str(e)[:200])
from verl.models.qwen3_5 import gated_deltanet as g
print('verl GDN uses fla on cuda:', torch.cuda.is_available() and g.use_fla(torch.device('cuda')))
EOF"
        ;;
    pytest)
        # a per-test limit where pytest-timeout is installed (it is on the lent machine): on 2026-11-21 an H200
        # run stalled >100 s in tests/models/test_gdn_fla_gpu.py::test_fla_conv_matches_torch
        PT_TIMEOUT=()
        "$PY" -c "import pytest_timeout" 2>/dev/null && PT_TIMEOUT=(--timeout "${T_PER_TEST:-150}")
        run_part pytest "${T_PYTEST:-240}" "$PY" -m pytest -v -m gpu tests/models tests/utils/kernel \
            tests/workers/engine/test_keys_fsdp_gpu.py -p no:cacheprovider -rsfE \
            --continue-on-collection-errors --durations=8 "${PT_TIMEOUT[@]}"
        ;;
    grpo)
        if [ "$SMOKE" = 1 ]; then
            run_part grpo "${T_GRPO:-600}" "$PY" scripts/gpu_grpo_step.py --tiny --response-length 8 \
                --filler-chars 20 --max-prompt-length 96 --workdir /tmp/verl_suite_grpo --metrics-out "$OUT/grpo_metrics.jsonl"
        else
            run_part grpo "${T_GRPO:-170}" "$PY" scripts/gpu_grpo_step.py --workdir /tmp/verl_suite_grpo \
                --metrics-out "$OUT/grpo_metrics.jsonl"
        fi
        ;;
    actor)
        if [ "$SMOKE" = 1 ]; then
            run_part actor "${T_ACTOR:-600}" "$PY" benchmarks/bench_actor_throughput.py --smoke --json "$OUT/actor.json"
        else
            run_part actor "${T_ACTOR:-150}" "$PY" benchmarks/bench_actor_throughput.py --json "$OUT/actor.json"
        fi
        ;;
    logprob)
        if [ "$SMOKE" = 1 ]; then
            run_part logprob "${T_LOGPROB:-300}" "$PY" benchmarks/bench_logprob.py --smoke
        else
            run_part logprob "${T_LOGPROB:-60}" "$PY" benchmarks/bench_logprob.py
        fi
        ;;
    megatron | sft | rollout)
        # the issue scripts keep their own per-part limits; this limit only bounds the whole script
        run_part "$part" "${T_ISSUE:-590}" env OUT="$OUT/$part" PARTS= bash "scripts/gpu_$part.sh"
        ;;
    *) say "unknown part $part" ;;
    esac
done

say ""
say "================================ SUMMARY ($((SECONDS - SUITE_START))s in all) ================================"
say "| part | exit | seconds |"
say "|---|---:|---:|"
for part in $PARTS; do
    [ -n "${RC[$part]+x}" ] && say "| $part | ${RC[$part]} | ${SECS[$part]} |"
done
if [ -f "$OUT/pytest.log" ]; then
    say ""
    say "pytest: $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR|SKIPPED)' "$OUT/pytest.log" | head -n 20 | tee -a "$LOG"
fi
# Re-print every result table (the blocks that start with '===' in the part logs).
for part in grpo actor logprob; do
    [ -f "$OUT/$part.log" ] || continue
    if [ "$part" = logprob ]; then
        say "=== (b) fused log-prob + entropy (benchmarks/bench_logprob.py) ==="
        sed -n '/^device=/,$p' "$OUT/logprob.log" | tee -a "$LOG"
    else
        awk '/^===/{p=1} p&&/^$/{c++} p{print} c>=2{p=0;c=0}' "$OUT/$part.log" | tee -a "$LOG"
    fi
done
exit 0
