#!/usr/bin/env bash
# GPU check of the SFT trainer on both engines: 5 SFT steps of the demo's tiny Qwen3.5 on the calculator-calls
# task with FSDP2 and with Megatron (same weights, same batches, packed sequences, bf16 compute), then the
# per-step train/loss of the two compared. Run from the repository root on a machine with one GPU and the
# mcore extra; logs (and the comparison) go to ${OUT:-outputs/gpu_sft}.
set -euo pipefail

OUT=${OUT:-outputs/gpu_sft}
WORK=${WORK:-/tmp/gpu_sft}  # demo assets and checkpoints (kept out of $OUT, which holds only the logs)
STEPS=${STEPS:-5}
TOL=${TOL:-0.03}  # relative; bf16 compute on both sides, different kernels
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 VERL_DEMO_DIR=${VERL_DEMO_DIR:-$WORK/demo}

COMMON=(trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.save_freq=-1 trainer.device=cuda
        trainer.logger='[console,file]' data.train_batch_size=16 data.micro_batch_size_per_gpu=8
        data.use_dynamic_bsz=false optim.lr=1e-3 optim.weight_decay=0 optim.clip_grad=1.0)

for engine in fsdp megatron; do
    extra=()
    if [ "$engine" = megatron ]; then
        extra=(engine=megatron engine.use_remove_padding=true optim.lr_warmup_steps=2)
    else
        extra=(optim.lr_warmup_steps=2)
    fi
    VERL_FILE_LOGGER_PATH="$OUT/$engine.jsonl" timeout 300 python -m verl.trainer.sft_trainer "${COMMON[@]}" \
        "${extra[@]}" trainer.default_local_dir="$WORK/$engine" 2>&1 | tee "$OUT/$engine.log" | grep -E "^step:|Error|error" || true
done

python - "$OUT" "$TOL" <<'PY'
import json, sys
out, tol = sys.argv[1], float(sys.argv[2])
loss = {e: [json.loads(l)["data"]["train/loss"] for l in open(f"{out}/{e}.jsonl")] for e in ("fsdp", "megatron")}
print("step  fsdp      megatron  rel.diff")
worst = 0.0
for i, (a, b) in enumerate(zip(loss["fsdp"], loss["megatron"]), 1):
    rel = abs(a - b) / abs(a)
    worst = max(worst, rel)
    print(f"{i:4d}  {a:.5f}  {b:.5f}  {rel:.2e}")
ok = len(loss["fsdp"]) == len(loss["megatron"]) > 0 and worst <= tol
print(f"max relative difference {worst:.2e} (tolerance {tol}): {'OK' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
PY
