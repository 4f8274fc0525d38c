"""Compare one SFT step's parameter updates of the FSDP and Megatron engines, tensor by tensor."""
import glob, os, sys
import torch
from safetensors.torch import load_file

work = sys.argv[1]
def load(d):
    sd = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        sd.update(load_file(f))
    return {k: v.float() for k, v in sd.items()}
init = load(glob.glob(os.path.join(work, "demo", "*", "tiny-qwen3_5"))[0])
f = load(os.path.join(work, "fsdp", "global_step_1", "huggingface"))
m = load(os.path.join(work, "megatron", "global_step_1", "huggingface"))
print("keys only in fsdp:", sorted(set(f) - set(m))[:8], "only in megatron:", sorted(set(m) - set(f))[:8])
print(f"{'tensor':60s} {'|dF|':>9s} {'|dM|':>9s} {'cos':>6s}")
for k in sorted(init):
    if k not in f or k not in m:
        print(k, "missing"); continue
    a, b = (f[k] - init[k]).flatten(), (m[k] - init[k]).flatten()
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if a.norm() > 0 and b.norm() > 0 else float("nan")
    print(f"{k:60s} {a.abs().mean():9.2e} {b.abs().mean():9.2e} {cos:6.3f}")
