"""Helpers shared by the benchmarks: timing, the measured bf16 matmul ceiling, GRPO-like length mixes."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
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


@dataclass
class MatmulCeiling:
    """A measured dense matmul rate: the median over many timed products taken after the clocks ramped."""

    median_tflops: float
    max_tflops: float
    n: int
    samples: int
    warmup_s: float
    dtype: str

    def describe(self) -> str:
        return (f"{self.median_tflops:.4g} TFLOP/s {self.dtype} (median of {self.samples} timed {self.n}^3 matmuls "
                f"after {self.warmup_s:.1f} s of warm-up; fastest {self.max_tflops:.4g})")


def matmul_ceiling(device: torch.device, n: int = 8192, samples: int = 100, min_warmup_s: float = 2.0,
                   max_warmup_s: float = 15.0) -> MatmulCeiling:
    """Measured dense matmul rate (bf16 on CUDA, fp32 on CPU) of ``n x n @ n x n`` on random data.

    A GPU starts a run at lower clocks and ramps under load, so a short timing reads low (an 8192^3 loop timed
    from cold read 674 TFLOP/s on an H200 that sustains ~774). Warm-up runs for at least ``min_warmup_s`` and
    until three consecutive groups of products agree within 1 % (at most ``max_warmup_s``); then ``samples``
    products are timed one by one (CUDA events around each, three operand sets rotated) and the median is the
    ceiling, so an outlier neither way moves it.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [(torch.randn(n, n, device=device, dtype=dtype, generator=gen),
             torch.randn(n, n, device=device, dtype=dtype, generator=gen)) for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    flop = 2 * n**3

    def group(k: int) -> None:
        for i in range(k):
            a, b = sets[i % 3]
            torch.mm(a, b, out=out)

    per_group = 10 if device.type == "cuda" else 1
    t0 = time.perf_counter()
    rates: list[float] = []
    while True:
        secs = median(time_fn(lambda: group(per_group), device, warmup=0, repeat=1))
        rates.append(flop * per_group / secs / 1e12)
        elapsed = time.perf_counter() - t0
        last = rates[-3:]
        settled = len(last) == 3 and max(last) <= 1.01 * min(last)
        if elapsed >= max_warmup_s or (elapsed >= min_warmup_s and settled):
            break
    warmup_s = time.perf_counter() - t0
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
        for i, (start, end) in enumerate(events):
            a, b = sets[i % 3]
            start.record()
            torch.mm(a, b, out=out)
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(samples):
            a, b = sets[i % 3]
            t1 = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - t1)
    return MatmulCeiling(median_tflops=flop / median(times) / 1e12, max_tflops=flop / min(times) / 1e12, n=n,
                         samples=samples, warmup_s=warmup_s, dtype=str(dtype).replace("torch.", ""))


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


def dense_twin_config(moe_cfg):
    """The dense twin of a Qwen3.5 MoE text config, with the same active parameters per token: the same
    attention and Gated DeltaNet layers, embedding and head, and one SwiGLU MLP as wide as the routed top-k
    experts plus the shared expert (35B-A3B: 8 x 512 + 512 = 4,608). Issue 20's MoE goal is the MoE update within
    1.5x this model's time per token (``bench_actor_throughput.py --shapes 35b-a3b,35b-a3b-dense`` on one GPU,
    ``scripts/gpu_scale.py megatron --dense-twin`` in a GRPO run)."""
    import transformers as tf

    dense_keys = set(tf.Qwen3_5TextConfig().to_dict())
    kw = {k: v for k, v in moe_cfg.to_dict().items() if k in dense_keys and k not in ("architectures", "model_type")}
    kw["intermediate_size"] = (moe_cfg.num_experts_per_tok * moe_cfg.moe_intermediate_size
                               + moe_cfg.shared_expert_intermediate_size)
    cfg = tf.Qwen3_5TextConfig(**kw)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def fmt_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" ---: " if i else " --- " for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
