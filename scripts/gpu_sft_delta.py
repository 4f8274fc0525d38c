"""Compare one SFT step's parameter updates of the FSDP and Megatron engines, tensor by tensor.

Usage: ``python scripts/gpu_sft_delta.py WORK`` after ``DELTA=1 scripts/gpu_sft.sh`` (which writes
``WORK/{fsdp,megatron}/global_step_1/huggingface``, the Hugging Face exports after step 1). The starting
weights are the demo model (``ensure_sft_assets`` with ``VERL_DEMO_DIR``, as the runs used). Prints, per
tensor, the mean absolute update of each engine, their ratio and cosine, then the whole model's; exits 1 when
an export is missing.

An export stored in bf16 rounds every weight to 8 significant bits, so an update smaller than about 2^-8 of
the weight is lost in it: the dtypes are printed first, and with a bf16 export only updates well above that
resolution (a larger LR) can be compared.
"""

import glob
import os
import sys

import torch
from safetensors.torch import load_file


def load(directory: str) -> tuple[dict, set]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        sys.exit(f"no *.safetensors under {directory}: run `DELTA=1 scripts/gpu_sft.sh` first (it saves step 1 "
                 "with checkpoint.save_contents including hf_model)")
    state = {}
    for f in files:
        state.update(load_file(f))
    return {k: v.float() for k, v in state.items()}, {str(v.dtype) for v in state.values()}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    work = sys.argv[1]
    os.environ.setdefault("VERL_DEMO_DIR", os.path.join(work, "demo"))
    from verl.trainer.demo.sft_task import ensure_sft_assets

    init, init_dtypes = load(ensure_sft_assets()["model"])
    f, f_dtypes = load(os.path.join(work, "fsdp", "global_step_1", "huggingface"))
    m, m_dtypes = load(os.path.join(work, "megatron", "global_step_1", "huggingface"))
    print(f"dtypes: initial {sorted(init_dtypes)}, fsdp export {sorted(f_dtypes)}, megatron export {sorted(m_dtypes)}")
    print("keys only in fsdp:", sorted(set(f) - set(m))[:8], "only in megatron:", sorted(set(m) - set(f))[:8])
    print(f"{'tensor':60s} {'|dF|':>9s} {'|dM|':>9s} {'M/F':>6s} {'cos':>6s}")
    all_f, all_m = [], []
    for k in sorted(init):
        if k not in f or k not in m:
            print(f"{k:60s} missing from {'fsdp' if k not in f else 'megatron'}")
            continue
        a, b = (f[k] - init[k]).flatten(), (m[k] - init[k]).flatten()
        all_f.append(a)
        all_m.append(b)
        both = a.norm() > 0 and b.norm() > 0
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if both else float("nan")
        ratio = float(b.abs().mean() / a.abs().mean()) if a.abs().mean() > 0 else float("nan")
        print(f"{k:60s} {a.abs().mean():9.2e} {b.abs().mean():9.2e} {ratio:6.3f} {cos:6.3f}")
    a, b = torch.cat(all_f), torch.cat(all_m)
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if a.norm() > 0 and b.norm() > 0 else float("nan")
    print(f"{'whole model':60s} {a.abs().mean():9.2e} {b.abs().mean():9.2e} "
          f"{float(b.abs().mean() / a.abs().mean()) if a.abs().mean() > 0 else float('nan'):6.3f} {cos:6.3f}")


if __name__ == "__main__":
    main()
