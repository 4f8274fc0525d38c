"""Gradients of the Gated DeltaNet kernel this package trains with, against a float64 token-by-token recurrence
(issue 20's A_log question).

On 2 x H100 (2026-11-26) the mcore parallel test's A_log gradient, fla on both sides (megatron-core's spec and
transformers' layer on CUDA), differed from its CPU "fp64" reference by a relative L2 of 5.7e2 (layer 0), 1.4e2
and 1.7; but that reference was transformers' torch chunk rule, which computes in fp32 whatever its input dtype.
On the CPU that rule matches a true fp64 recurrence to 1.5e-6 in every gradient (g included), so the question left
is fla's own d(g) at the decays the test's random model has. This script asks it directly: one packed batch,
``gated_delta_rule`` (fla's chunk kernel on CUDA, the package's torch chunk rule elsewhere) against the fp64
recurrence, for several per-token decay scales (a strong decay makes the true d(g) tiny, and a relative figure
then says little: the absolute error and the reference's norm are printed with it).

    python scripts/gpu_gdn_grad_check.py              # CUDA: fla
    python scripts/gpu_gdn_grad_check.py --device cpu # the torch chunk rule (a smoke test of this script)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def recurrence_fp64(q, k, v, g, beta, cu):
    """Token by token in float64, every sequence of the packed row from a zero state; q and k l2-normalised as
    ``use_qk_l2norm_in_kernel`` does (same eps)."""
    from verl.models.qwen3_5.gated_deltanet import l2_normalize

    q, k, v, g, beta = (z.double() for z in (q, k, v, g, beta))
    q, k = l2_normalize(q), l2_normalize(k)
    scale = k.shape[-1] ** -0.5
    out = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        state = q.new_zeros(q.shape[2], k.shape[-1], v.shape[-1])
        for t in range(lo, hi):
            state = state * g[0, t].exp()[:, None, None]
            err = v[0, t] - torch.einsum("hkv,hk->hv", state, k[0, t])
            state = state + k[0, t][..., None] * (beta[0, t][:, None] * err)[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", state, q[0, t] * scale))
    return torch.stack(out)[None]


def case(device, dtype, lengths, heads, dk, dv, decay, seed=0):
    from verl.models.qwen3_5.gated_deltanet import gated_delta_rule

    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    base = [torch.randn(1, t, heads, dk, generator=gen), torch.randn(1, t, heads, dk, generator=gen),
            torch.randn(1, t, heads, dv, generator=gen), -decay * torch.rand(1, t, heads, generator=gen),
            torch.rand(1, t, heads, generator=gen)]
    w = torch.randn(1, t, heads, dv, generator=gen)
    grads = {}
    for name in ("kernel", "fp64"):
        xs = [z.clone().to(device, torch.float64 if name == "fp64" else dtype).requires_grad_() for z in base]
        if name == "kernel":
            out = gated_delta_rule(*xs, cu_seqlens=cu.to(device), use_qk_l2norm=True)
        else:
            out = recurrence_fp64(*xs, cu)
        (out.double() * w.to(device).double()).sum().backward()
        grads[name] = [out.detach().double().cpu()] + [z.grad.double().cpu() for z in xs]
    row = {}
    for label, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), grads["kernel"], grads["fp64"]):
        row[label] = ((a - b).norm() / b.norm().clamp_min(1e-300)).item(), (a - b).abs().max().item(), b.norm().item()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--decays", default="0.05,0.5,2,13", help="per-token log-decay drawn from -decay * U(0, 1)")
    args = p.parse_args(argv)
    from verl.models.qwen3_5.gated_deltanet import gdn_backend

    print(f"[gdn grad] device {args.device}, kernel: {gdn_backend(torch.device(args.device).type)}")
    # 16/16: the mcore parallel test's tiny model (g ~ -13 per token there before it set realistic decays)
    shapes = [("tiny model dims", [37, 5, 64, 20], 4, 16, 16), ("Qwen3.5 dims", [200, 90], 2, 128, 128)]
    print("| shape | dtype | decay | out | dq | dk | dv | dg (rel / max abs / ref norm) | dbeta |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    worst = 0.0
    for label, lengths, heads, dk, dv in shapes:
        for dtype in args.dtypes.split(","):
            if args.device == "cpu" and dtype == "bfloat16":
                continue  # the torch rule computes in fp32 whatever the input; bf16 inputs only round them
            for decay in (float(d) for d in args.decays.split(",")):
                r = case(args.device, getattr(torch, dtype), lengths, heads, dk, dv, decay)
                rel = lambda k: f"{r[k][0]:.1e}"  # noqa: E731
                dg = r["dg"]
                print(f"| {label} | {dtype} | {decay:g} | {rel('out')} | {rel('dq')} | {rel('dk')} | {rel('dv')} | "
                      f"{dg[0]:.1e} / {dg[1]:.1e} / {dg[2]:.1e} | {rel('dbeta')} |", flush=True)
                if dtype == "float32":
                    worst = max(worst, max(v[0] for v in r.values()))
    print(f"[gdn grad] worst relative L2 in fp32: {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
