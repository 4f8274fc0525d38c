"""The decode step's sampler over the vocabulary: the unfused sampler it replaced vs the fused one.

Rows (same logits and uniforms, one process):

* ``unfused``      - the old chain (fp32 copy, /T, log-sum-exp, softmax, cumsum, compare, count), kept as the
                     tests' oracle (``tests/workers/rollout/sampler_reference.py``);
* ``fused-torch``  - :func:`verl.workers.rollout.hf_engine.fused_sampler.torch_fused_sample` (CPU path);
* ``fused-triton`` - the Triton kernel (CUDA with Triton only).

Columns: median ms per call (CUDA events after warm-up), the time as a ratio of ``unfused`` in the same run,
and the effective bandwidth of reading the bf16 logits once (bytes / time), to compare with the card's HBM rate.

    python benchmarks/bench_sampler.py                       # B = 64, 256; V = 248,320; bf16 (CUDA)
    python benchmarks/bench_sampler.py --smoke               # tiny sizes, works on CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import fmt_table, median, time_fn  # noqa: E402


def main() -> None:
    from tests.workers.rollout.sampler_reference import reference_sample
    from verl.workers.rollout.hf_engine.fused_sampler import _kernel, torch_fused_sample
    from verl.workers.rollout.hf_engine.sampling import counter_uniform

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="B = 4, V = 1000, 3 repeats")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.vocab, args.repeat = "4", 1000, 3
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel = _kernel() if dev.type == "cuda" else None
    if dev.type == "cuda" and kernel is None:
        print("warning: triton is not importable; no fused-triton row", file=sys.stderr)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        logits = (torch.randn(b, args.vocab, device=dev) * 3).to(dtype)
        keys, steps = torch.arange(b, device=dev) * 7919, torch.zeros(b, dtype=torch.long, device=dev)
        u = counter_uniform(keys, steps)
        t = args.temperature
        impls = {"unfused": lambda: reference_sample(logits, t, keys, steps),
                 "fused-torch": lambda: torch_fused_sample(logits, t, u)}
        if kernel is not None:
            impls["fused-triton"] = lambda: kernel(logits, t, u)
        base = None
        for name, fn in impls.items():
            ms = median(time_fn(fn, dev, warmup=3, repeat=args.repeat)) * 1e3
            base = base or ms
            gbps = logits.numel() * logits.element_size() / (ms / 1e3) / 1e9
            rows.append([str(b), name, f"{ms:.3f}", f"{ms / base:.3f}", f"{gbps:.0f}"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name}, V={args.vocab}, {str(dtype).replace('torch.', '')} logits, T={args.temperature}")
    print(fmt_table(["B", "sampler", "ms", "time / unfused", "GB/s (one read)"], rows))


if __name__ == "__main__":
    main()
