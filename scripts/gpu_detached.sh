#!/usr/bin/env bash
# A GPU command longer than one device call allows: the device tool kills what a call leaves running, except a
# process that started its own session (setsid), which runs until the machine goes back. So one call starts the
# command in its own session and returns; the calls after it (back to back: the machine is released after a short
# idle time) wait for it, each up to a limit, printing the log's new lines, and the last one gets its exit code.
#
#   bash scripts/gpu_detached.sh start NAME CMD...     start CMD (a new session; log /tmp/detached/NAME.log)
#   bash scripts/gpu_detached.sh wait NAME SECONDS     wait up to SECONDS; exit 0 when it ended with 0, its exit
#                                                      code when it ended otherwise, 124 while it still runs
#   bash scripts/gpu_detached.sh stop NAME             end it (its whole session)
#
# e.g. start scale9b "$PY" scripts/gpu_scale.py fsdp --gpus 4 --stage train, then "wait scale9b 560" per call
# until it stops answering 124. The environment of the start call (PYTHONPATH, ...) is the command's, less OUT.
# On the device machine (root) a 10-minute GRPO launch on 4 x H200 ran this way across two calls (2026-11-27). Its
# README: where commands run as an ordinary user rather than root, every process of that user is ended after a
# call, a new session too; the start call prints the user.
set -u
dir=${DETACHED_DIR:-/tmp/detached}
mkdir -p "$dir"
cmd=${1:-}
name=${2:-}
[[ -n $cmd && -n $name ]] || { sed -n '2,16p' "$0" >&2; exit 2; }
log=$dir/$name.log pidf=$dir/$name.pid rcf=$dir/$name.rc seen=$dir/$name.seen

case $cmd in
start)
    shift 2
    [[ $# -gt 0 ]] || { echo "start $name: no command" >&2; exit 2; }
    if [[ -f $pidf ]] && kill -0 "$(cat "$pidf")" 2>/dev/null; then
        echo "$name is already running (pid $(cat "$pidf"))" >&2
        exit 1
    fi
    rm -f "$rcf" "$seen" "$pidf"
    # The inner shell, once in its new session, writes its pid (the session's id) and, at the end, the exit
    # code, so a later call can tell "ended with N" from "still running". Holding the caller's stdout would
    # hold the call open until the command ends.
    # Without OUT: the device tool points it at a folder it empties at the start of every call, so a command
    # outliving its call would write its logs there and lose them (scripts fall back to their own folders).
    setsid env -u OUT bash -c 'echo $$ > "$3"; log=$1 rcf=$2; shift 3; "$@" > "$log" 2>&1
                    echo $? > "$rcf.tmp" && mv "$rcf.tmp" "$rcf"' _ "$log" "$rcf" "$pidf" "$@" \
        < /dev/null > /dev/null 2>&1 &
    for _ in $(seq 50); do [[ -s $pidf ]] && break; sleep 0.1; done
    [[ -s $pidf ]] || { echo "$name did not start" >&2; exit 1; }
    echo "started $name (pid $(cat "$pidf"), a session of its own, as $(id -un)): log $log"
    ;;
wait)
    limit=${3:?wait NAME SECONDS}
    [[ -f $pidf ]] || { echo "$name was never started here" >&2; exit 2; }
    t0=$SECONDS
    while [[ ! -f $rcf ]] && (( SECONDS - t0 < limit )); do
        sleep 2
    done
    # the lines not printed by an earlier call
    from=$(( $(cat "$seen" 2>/dev/null || echo 0) + 1 ))
    total=$(wc -l < "$log")
    tail -n +"$from" "$log" | tail -n "${TAIL:-80}"
    echo "$total" > "$seen"
    if [[ -f $rcf ]]; then
        rc=$(cat "$rcf")
        echo "[$name] ended with exit code $rc"
        exit "$rc"
    fi
    echo "[$name] still running after this call's ${limit} s (log: $total lines)"
    exit 124
    ;;
stop)
    [[ -f $pidf ]] || exit 0
    kill -- -"$(cat "$pidf")" 2>/dev/null || kill "$(cat "$pidf")" 2>/dev/null
    [[ -f $rcf ]] || echo 143 > "$rcf"  # what a later wait reports: ended by SIGTERM
    echo "stopped $name"
    ;;
*)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
