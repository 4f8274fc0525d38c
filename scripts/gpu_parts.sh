# Sourced by the GPU check scripts that run in parts (gpu_rollout.sh, gpu_vllm.sh): the environment every part
# shares and `run_part NAME LIMIT_SECONDS CMD...`, which runs one part under its own time limit, keeps its log
# in $OUT/NAME.log, prints the log's tail (TAIL lines, default 40) and records the exit code and seconds.
# The sourcing script sets OUT first (its own default folder) and ends with `parts_summary`.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" ;; esac
PY="${PYTHON:-python3}"
declare -A RC SECS

kernel_caches() {  # Triton's and TileLang's on-disk kernel caches: they grow when a part compiles
    echo "kernel caches: Triton $(ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l)," \
        "TileLang $(ls "${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}" 2>/dev/null | wc -l) entries"
}

run_part() {
    local name=$1 limit=$2; shift 2
    echo "################ [$name] $(date -u +%H:%M:%S) limit ${limit}s, $(kernel_caches): $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    RC[$name]=$?
    SECS[$name]=$((SECONDS - t0))
    # vLLM's INFO lines and transformers' load chatter would push the result out of the tail
    grep -v '^\[transformers\]\|^INFO \|^(EngineCore' "$OUT/$name.log" | tail -n "${TAIL:-40}"
    # before and after: a first launch on a fresh machine compiles fla's kernels in its first step (~100 s more
    # than step 2 on 2026-11-28, 2 x H200 and 2 x H100, not in later launches)
    echo "################ [$name] exit ${RC[$name]} after ${SECS[$name]}s; $(kernel_caches)"
}

parts_summary() {
    echo "| part | exit | seconds |"
    local k
    for k in "${!RC[@]}"; do echo "| $k | ${RC[$k]} | ${SECS[$k]} |"; done
}
