# Sourced by the GPU check scripts that run in parts (gpu_rollout.sh, gpu_vllm.sh): the environment every part
# shares and `run_part NAME LIMIT_SECONDS CMD...`, which runs one part under its own time limit, keeps its log
# in $OUT/NAME.log, prints the log's tail (TAIL lines, default 40) and records the exit code and seconds.
# The sourcing script sets OUT first (its own default folder) and ends with `parts_summary`.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" ;; esac
PY="${PYTHON:-python3}"
declare -A RC SECS

run_part() {
    local name=$1 limit=$2; shift 2
    echo "################ [$name] $(date -u +%H:%M:%S) limit ${limit}s: $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    RC[$name]=$?
    SECS[$name]=$((SECONDS - t0))
    # vLLM's INFO lines and transformers' load chatter would push the result out of the tail
    grep -v '^\[transformers\]\|^INFO \|^(EngineCore' "$OUT/$name.log" | tail -n "${TAIL:-40}"
    echo "################ [$name] exit ${RC[$name]} after ${SECS[$name]}s"
}

parts_summary() {
    echo "| part | exit | seconds |"
    local k
    for k in "${!RC[@]}"; do echo "| $k | ${RC[$k]} | ${SECS[$k]} |"; done
}
