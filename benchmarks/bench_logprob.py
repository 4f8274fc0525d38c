"""Peak memory and time of log-prob + entropy through the LM head, fwd + bwd.

Compares, in one process and on the same inputs:

  (a) materialised: ``logits = hidden @ W.T`` then ``log_softmax`` / gather / entropy in fp32
  (b) ``linear_log_prob_entropy(backend="torch")``  (token-chunked, recomputing backward)
  (c) ``linear_log_prob_entropy(backend="triton")`` (Triton forward + Triton dlogits / cuBLAS backward)

Defaults: N=18,000 tokens, H=2048, V=248,320 (Qwen3.5 vocab), bf16. Time is the median of
``--repeat`` CUDA-event-timed fwd+bwd runs after ``--warmup`` runs; peak memory is
``torch.cuda.max_memory_allocated()`` after a reset, minus what was allocated before the call
(inputs and the ``.grad`` buffers of earlier runs are freed first). Ratios are vs (a).

    python benchmarks/bench_logprob.py                # CUDA, full size
    python benchmarks/bench_logprob.py --smoke        # tiny sizes; runs on CPU too
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl.utils.kernel import linear_log_prob_entropy


def materialised(hidden, weight, labels, temperature):
    """What the fused op replaces: full logits in the input dtype, softmax math in fp32."""
    logits = (hidden @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy


def _make_fn(name, chunk_size):
    if name == "materialised":
        return materialised

    def fused(hidden, weight, labels, temperature):
        return linear_log_prob_entropy(hidden, weight, labels, temperature, chunk_size=chunk_size, backend=name)

    return fused


def _step(fn, hidden, weight, labels, temperature, g_lp, g_ent):
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, labels, temperature)
    (lp * g_lp + ent * g_ent).sum().backward()


def measure(fn, args, warmup, repeat, cuda):
    hidden, weight = args[0], args[1]
    for _ in range(warmup):
        _step(fn, *args)
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            _step(fn, *args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            _step(fn, *args)
            times.append((time.perf_counter() - t0) * 1e3)
    peak = float("nan")
    if cuda:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, *args)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    hidden.grad = weight.grad = None
    return statistics.median(times), peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=18_000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: auto, ~1 GiB)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--impls", default="materialised,torch,triton")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CPU-friendly)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.warmup, args.repeat = 300, 64, 1000, 1, 2
        args.chunk_size = args.chunk_size or 64
    impls = [s for s in args.impls.split(",") if s]
    if not cuda and "triton" in impls:
        print("no CUDA: skipping the triton backend")
        impls.remove("triton")
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)

    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=g) / args.hidden**0.5)
    weight = weight.to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    g_lp = torch.randn(args.tokens, device=device, generator=g)
    g_ent = torch.randn(args.tokens, device=device, generator=g)
    step_args = (hidden, weight, labels, args.temperature, g_lp, g_ent)

    dev_name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"device={dev_name} N={args.tokens} H={args.hidden} V={args.vocab} dtype={args.dtype} "
          f"T={args.temperature} chunk={args.chunk_size or 'auto'}")
    rows = []
    for name in impls:
        try:
            ms, peak = measure(_make_fn(name, args.chunk_size), step_args, args.warmup, args.repeat, cuda)
        except torch.OutOfMemoryError as exc:  # the materialised path may not fit
            print(f"{name}: OOM ({str(exc).splitlines()[0]})")
            torch.cuda.empty_cache()
            continue
        rows.append((name, ms, peak))
        if cuda:
            torch.cuda.empty_cache()

    ref = next((r for r in rows if r[0] == "materialised"), None)
    print(f"{'impl':<14}{'time ms':>10}{'peak GiB':>10}{'time/(a)':>10}{'mem/(a)':>10}")
    for name, ms, peak in rows:
        t_ratio = ms / ref[1] if ref else float("nan")
        m_ratio = peak / ref[2] if ref and ref[2] == ref[2] else float("nan")
        print(f"{name:<14}{ms:>10.2f}{peak:>10.3f}{t_ratio:>10.3f}{m_ratio:>10.3f}")
    return rows


if __name__ == "__main__":
    main()
