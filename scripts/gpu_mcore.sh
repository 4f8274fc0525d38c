#!/usr/bin/env bash
# GPU check of the megatron-core Qwen3.5 model (local spec, world size 1) against Hugging Face:
# packed log-probs (fp32 <= 1e-4, bf16 tolerance), fused vs full logits, entropy and gradients, for tiny dense,
# MoE and VL-MoE checkpoints, fla's GDN gradients against torch references, router replay on the tiny MoE; with 2 GPUs also TP / SP / EP 2
# against HF. Installs nothing: expects megatron-core and fla importable, e.g. on the lent machine after the
# wheels of /work/main/.whl (tilelang included: fla's Hopper backward needs it) went into /tmp/site:
#
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_mcore.sh
#
# Output is tee'd into $OUT/gpu_mcore.log (default ./gpu_mcore_out/).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_mcore_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" ;; esac
PY="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$PY" -c "import torch, transformers, megatron.core as m, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__, 'fla', fla.__version__)"
  # the grouped-GEMM experts against SequentialMLP (no gpu marker: it runs on CPU too where megatron-core imports)
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/models/mcore/test_grouped_experts.py 2>&1 | tail -3
  timeout --signal=INT "${T_PYTEST:-900}" "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/models/mcore/test_mcore_qwen3_5_gpu.py tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py tests/models/mcore/test_mcore_router_replay_gpu.py 2>&1 \
    | grep -v "Writing model shards\|Loading weights"
  echo "pytest exit: ${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/gpu_mcore.log"
grep -q "pytest exit: 0" "$OUT/gpu_mcore.log"
