"""Token sampling on the device, with a random stream per sequence.

Every sequence owns a 31-bit key; the uniform number used at its ``step``-th token is a hash of (key, step)
computed with integer tensor ops. A sequence's samples therefore depend only on its key, never on which other
sequences share the batch, in which slot it sits, or when it was admitted: continuous batching and one-by-one
generation give the same tokens. Sampling is inverse-CDF over the (top-k / top-p filtered) distribution, so a
step needs one uniform per row, and nothing here syncs with the host (the decode step can be a CUDA graph).
Greedy and unfiltered sampling run fused (:mod:`verl.workers.rollout.hf_engine.fused_sampler`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from verl.workers.rollout.hf_engine import fused_sampler

_MASK32 = 0xFFFFFFFF


def sequence_key(seed: int, prompt_ids: Sequence[int], occurrence: int, extra: bytes = b"") -> int:
    """Stable 31-bit key of the ``occurrence``-th sample of a prompt (same prompt + seed -> same stream)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{int(seed)}:{int(occurrence)}:".encode())
    h.update(torch.as_tensor(list(prompt_ids), dtype=torch.int64).numpy().tobytes())
    h.update(extra)
    return int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF


def counter_uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1), one per row, from int64 ``keys`` (< 2**31) and ``steps``.

    A 32-bit integer mix (multiply / xor-shift rounds). Values stay below 2**32 and constants below 2**31, so
    every product fits in int64 and CPU and GPU give identical bits.
    """
    x = (keys * 0x9E3779B1 + (steps & _MASK32) * 0x7FEB352D + 0x165667B1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplerConfig:
    """Sampling settings fixed for one generate call (baked into captured graphs)."""

    temperature: float  # <= 0: greedy
    top_k: int = -1
    top_p: float = 1.0
    suppress_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sample_tokens(logits: torch.Tensor, cfg: SamplerConfig, keys: torch.Tensor, steps: torch.Tensor,
                  suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs) for logits (B, V).

    Log-probs are those of the sampled token under softmax(logits / T) over the whole vocabulary (T = 1 when
    greedy), i.e. what the trainer recomputes; top-k / top-p and suppressed ids only restrict what can be drawn.
    Greedy and plain temperature sampling (the RL default) take the fused path (:mod:`.fused_sampler`: one
    Triton kernel on CUDA); top-k / top-p need the candidates ordered and take :func:`filtered_sample_tokens`.
    """
    vocab = logits.shape[-1]
    if not cfg.greedy and ((0 < cfg.top_k < vocab) or cfg.top_p < 1.0):
        return filtered_sample_tokens(logits, cfg, keys, steps, suppress_index)
    u = None if cfg.greedy else counter_uniform(keys, steps)
    temperature = 1.0 if cfg.greedy else float(cfg.temperature)
    return fused_sampler.fused_sample(logits, temperature, u, suppress_index)


def filtered_sample_tokens(logits: torch.Tensor, cfg: SamplerConfig, keys: torch.Tensor, steps: torch.Tensor,
                           suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k / top-p sampling: inverse-CDF over the candidates in descending order (``torch.topk`` for top-k,
    a full sort for top-p alone), with the draw's uniform from :func:`counter_uniform`."""
    raw = logits.float()
    temp = float(cfg.temperature)
    scaled = raw / temp if temp != 1.0 else raw
    lse = torch.logsumexp(scaled, dim=-1)
    cand = scaled
    if suppress_index is not None and suppress_index.numel():
        cand = scaled.index_fill(-1, suppress_index, float("-inf"))
    if 0 < cfg.top_k < cand.shape[-1]:
        cand, index = torch.topk(cand, cfg.top_k, dim=-1)  # sorted, largest first
    else:
        cand, index = torch.sort(cand, dim=-1, descending=True)
    probs = torch.softmax(cand, dim=-1)
    if cfg.top_p < 1.0:
        before = probs.cumsum(-1) - probs  # mass strictly ahead of each candidate
        probs = probs.masked_fill(before > cfg.top_p, 0.0)  # the top candidate always survives
    cdf = probs.cumsum(-1)
    u = counter_uniform(keys, steps) * cdf[:, -1]
    pick = (cdf < u[:, None]).sum(-1).clamp(max=cand.shape[-1] - 1)
    tokens = index.gather(-1, pick[:, None]).squeeze(-1)
    log_probs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, log_probs
