"""Helpers shared by the benchmarks: timing, the measured bf16 matmul ceiling, GRPO-like length mixes."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, repeat: int) -> list[float]:
    """Seconds per call of ``fn``, ``repeat`` timings after ``warmup`` untimed calls (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def matmul_ceiling_tflops(device: torch.device, n: int = 8192, iters: int = 20, repeat: int = 5) -> float:
    """Measured bf16 dense matmul rate (TFLOP/s): median over ``repeat`` timings of ``iters`` back-to-back
    ``n x n @ n x n`` products on random data (three operand sets rotated, so no run hits a warm cache)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [(torch.randn(n, n, device=device, dtype=dtype, generator=gen),
             torch.randn(n, n, device=device, dtype=dtype, generator=gen)) for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dtype)

    def loop():
        for i in range(iters):
            a, b = sets[i % 3]
            torch.mm(a, b, out=out)

    secs = median(time_fn(loop, device, warmup=2, repeat=repeat))  # warm-up also lets the clocks settle
    return 2 * n**3 * iters / secs / 1e12


def grpo_length_mix(n: int = 16, seed: int = 1, prompt_range=(100, 500), response_median: float = 700.0,
                    response_sigma: float = 0.9, response_clip=(50, 4000)) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths): prompts uniform on ``prompt_range`` (inclusive), responses
    log-normal with the given median and log-space sigma, rounded and clipped to ``response_clip``.
    The defaults (seed 1, sigma 0.9) give 18,662 tokens in 16 sequences, longest 2,446 (pad fraction 0.52)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    responses = rng.lognormal(np.log(response_median), response_sigma, n)
    responses = np.clip(np.round(responses), response_clip[0], response_clip[1]).astype(int)
    return [int(x) for x in prompts], [int(x) for x in responses]


def fmt_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" ---: " if i else " --- " for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
