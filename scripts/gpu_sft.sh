#!/usr/bin/env bash
# GPU check of the SFT trainer on both engines: $STEPS SFT steps of the demo's tiny Qwen3.5 on the
# calculator-calls task with FSDP2 and with Megatron (same weights, same batches, packed sequences, bf16
# compute), then the per-step train/loss and grad norm of the two compared and printed. Run from the repository
# root on a machine with one GPU and the mcore extra; logs (and the comparison) go to ${OUT:-outputs/gpu_sft}.
#
# Environment:
#   LR=1e-3 WARMUP=2        optim.lr and optim.lr_warmup_steps, the same on both engines
#   OPTIMIZER=adamw|sgd     AdamW (default) or plain SGD (momentum 0 on both engines). Adam's first update is
#                           about lr * sign(grad), so a tiny gradient whose sign bf16 noise flips moves its weight
#                           by a full lr; SGD's update is proportional to the gradient and separates a real
#                           gradient difference from that amplification.
#   STEPS=5                 steps per run
#   TOL=auto|<number>       relative loss tolerance per step. auto: bf16 noise measured in this run - a second
#                           FSDP run with another micro-batch split (same math, different rounding and
#                           summation order), times 4, and at least 2^-8 (bf16's unit roundoff)
#   DELTA=1                 one step only (no warm-up), saved with a Hugging Face export (checkpoint.save_contents
#                           with hf_model), then scripts/gpu_sft_delta.py compares the two engines' parameter
#                           updates tensor by tensor
set -euo pipefail

OUT=${OUT:-outputs/gpu_sft}
WORK=${WORK:-/tmp/gpu_sft}  # demo assets and checkpoints (kept out of $OUT, which holds only the logs)
STEPS=${STEPS:-5}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-2}
OPTIMIZER=${OPTIMIZER:-adamw}
TOL=${TOL:-auto}
DELTA=${DELTA:-0}
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 VERL_DEMO_DIR=${VERL_DEMO_DIR:-$WORK/demo}

case "${OPTIMIZER,,}" in
    adamw|adam) FSDP_OPTIM=(optim.optimizer=AdamW) MCORE_OPTIM=(optim.optimizer=adam) ;;
    # megatron-core's SGD defaults to momentum 0.9; torch.optim.SGD to 0.
    sgd) FSDP_OPTIM=(optim.optimizer=SGD)
         MCORE_OPTIM=(optim.optimizer=sgd +optim.override_optimizer_config.sgd_momentum=0.0) ;;
    *) echo "OPTIMIZER=$OPTIMIZER: use adamw or sgd" >&2; exit 2 ;;
esac

SAVE=(trainer.save_freq=-1)
if [ "$DELTA" = 1 ]; then
    STEPS=1
    if [ "$WARMUP" != 0 ]; then  # the warm-up schedule gives its first step a learning rate of 0: no update
        echo "DELTA=1 compares the update of step 1, so WARMUP=0 (was $WARMUP)"
        WARMUP=0
    fi
    SAVE=(trainer.save_freq=1 "checkpoint.save_contents=[model,optimizer,extra,hf_model]")
fi

COMMON=(trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.device=cuda trainer.resume_mode=disable
        trainer.logger='[console,file]' data.train_batch_size=16 data.use_dynamic_bsz=false
        optim.lr="$LR" optim.lr_warmup_steps="$WARMUP" optim.weight_decay=0 optim.clip_grad=1.0 "${SAVE[@]}")
echo "SFT parity: steps=$STEPS lr=$LR warmup=$WARMUP optimizer=$OPTIMIZER delta=$DELTA tol=$TOL"

run() {  # name, then the run's own overrides
    local name=$1
    shift
    rm -rf "${WORK:?}/$name" "$OUT/$name.jsonl"
    VERL_FILE_LOGGER_PATH="$OUT/$name.jsonl" timeout 300 "$PY" -m verl.trainer.sft_trainer "${COMMON[@]}" "$@" \
        trainer.default_local_dir="$WORK/$name" 2>&1 | tee "$OUT/$name.log" | grep -E "^step |[Ee]rror" || true
}

run fsdp "${FSDP_OPTIM[@]}" data.micro_batch_size_per_gpu=8
run megatron engine=megatron engine.use_remove_padding=true "${MCORE_OPTIM[@]}" data.micro_batch_size_per_gpu=8
if [ "$DELTA" = 1 ]; then
    "$PY" scripts/gpu_sft_delta.py "$WORK" | tee "$OUT/delta.txt"
    exit 0
fi
if [ "$TOL" = auto ]; then
    run fsdp_noise "${FSDP_OPTIM[@]}" data.micro_batch_size_per_gpu=4
fi

"$PY" - "$OUT" "$TOL" <<'PY'
import json
import os
import sys

out, tol_arg = sys.argv[1], sys.argv[2]


def series(name, key):
    path = f"{out}/{name}.jsonl"
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: the {name} run failed (see {out}/{name}.log)")
    return [json.loads(line)["data"][key] for line in open(path)]


loss = {e: series(e, "train/loss") for e in ("fsdp", "megatron")}
gnorm = {e: series(e, "train/grad_norm") for e in ("fsdp", "megatron")}
BF16_ROUNDOFF = 2.0 ** -8
if tol_arg == "auto":
    noise = series("fsdp_noise", "train/loss")
    # Per step: 4x the relative gap of two FSDP runs that differ only in rounding, never below bf16's roundoff.
    tols = [max(4 * abs(a - b) / abs(a), BF16_ROUNDOFF) for a, b in zip(loss["fsdp"], noise)]
else:
    noise = None
    tols = [float(tol_arg)] * len(loss["fsdp"])
print("step  fsdp loss  mcore loss  rel.diff  " + ("noise rel  " if noise else "")
      + "tol       fsdp gnorm  mcore gnorm")
ok = len(loss["fsdp"]) == len(loss["megatron"]) == len(tols) > 0
worst = 0.0
for i, (a, b) in enumerate(zip(loss["fsdp"], loss["megatron"])):
    rel = abs(a - b) / abs(a)
    worst = max(worst, rel / tols[i])
    ok = ok and rel <= tols[i]
    cells = [f"{i + 1:4d}", f"{a:9.5f}", f"{b:10.5f}", f"{rel:8.2e}"]
    if noise:
        cells.append(f"{abs(a - noise[i]) / abs(a):9.2e}")
    cells += [f"{tols[i]:8.2e}", f"{gnorm['fsdp'][i]:10.5f}", f"{gnorm['megatron'][i]:11.5f}"]
    print("  ".join(cells))
print(f"largest rel.diff / tol = {worst:.2f}: {'OK' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
