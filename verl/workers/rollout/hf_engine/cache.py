"""Preallocated per-slot decoding state for a hybrid Qwen3.5 model, plus the per-slot bookkeeping rows.

One tensor per kind of state, with the slot as the second dimension, so that moving or copying a slot is one
indexed copy per tensor and the rows ``[:b]`` of a layer are a contiguous view (what a batch-size bucket's
CUDA graph reads and writes in place):

* ``kv``:   (n_attn_layers, 2, slots, kv_heads, max_len, head_dim) keys and values of the full-attention layers
  (head-major so that one slot/head's cache is a contiguous (L, D) matrix for the decode matmuls);
* ``conv``: (n_gdn_layers, slots, conv_width - 1, conv_dim) the last pre-conv q/k/v inputs of each sequence;
* ``rec``:  (n_gdn_layers, slots, v_heads, k_dim, v_dim) the Gated DeltaNet recurrent state (fp32 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class CacheShape:
    n_attn: int
    kv_heads: int
    head_dim: int
    n_gdn: int
    conv_width: int
    conv_dim: int
    v_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def from_text_config(cls, cfg) -> "CacheShape":
        types = list(cfg.layer_types)
        return cls(
            n_attn=types.count("full_attention"),
            kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            n_gdn=types.count("linear_attention"),
            conv_width=cfg.linear_conv_kernel_dim,
            conv_dim=2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            v_heads=cfg.linear_num_value_heads,
            k_dim=cfg.linear_key_head_dim,
            v_dim=cfg.linear_value_head_dim,
        )

    def bytes_per_slot(self, max_len: int, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        e, s = torch.empty(0, dtype=dtype).element_size(), torch.empty(0, dtype=state_dtype).element_size()
        kv = self.n_attn * 2 * self.kv_heads * max_len * self.head_dim * e
        conv = self.n_gdn * (self.conv_width - 1) * self.conv_dim * e
        rec = self.n_gdn * self.v_heads * self.k_dim * self.v_dim * s
        return kv + conv + rec


@dataclass
class SpecShape:
    """What speculative decoding adds per slot: ``k`` draft tokens per step, the drafter's (MTP) attention layers
    and the main model's hidden size."""

    k: int
    n_draft_attn: int
    hidden: int

    def bytes_per_slot(self, shape: CacheShape, max_len: int, dtype, state_dtype) -> int:
        e, s = torch.empty(0, dtype=dtype).element_size(), torch.empty(0, dtype=state_dtype).element_size()
        kv = self.n_draft_attn * 2 * shape.kv_heads * (max_len + self.k) * shape.head_dim * e
        rec_hist = self.k * shape.n_gdn * shape.v_heads * shape.k_dim * shape.v_dim * s
        conv_ext = shape.n_gdn * (shape.conv_width + self.k) * shape.conv_dim * e
        return kv + rec_hist + conv_ext + (self.k + 1) * self.hidden * e


class SpecState:
    """Per-slot state of speculative decoding (see :mod:`verl.workers.rollout.hf_engine.speculative`).

    * ``kv``: (n_draft_attn, 2, slots, kv_heads, max_len + k, head_dim) the drafter's attention cache; its entries
      below ``lengths - count`` are final (the drafter has seen the target's hidden state there);
    * ``hid`` / ``ctok`` / ``count``: the ``count`` (1 .. k + 1) newest target hidden states the drafter has not
      consumed yet (positions ``lengths - count ..``) and the token following each (the last one is the pending
      token, ``SlotCache.tokens``);
    * ``rec_hist`` / ``conv_ext``: scratch of one verification forward (the Gated DeltaNet recurrent states after
      each of its first k tokens, and each layer's conv window extended by its k + 1 inputs), from which the states
      after the last accepted token are restored;
    * ``seq_stats``: (slots, 3) per sequence: draft tokens proposed, drafts accepted, verification steps.
    """

    def __init__(self, spec: SpecShape, shape: CacheShape, slots: int, max_len: int, device, dtype, state_dtype):
        z = dict(device=device)
        k = spec.k
        self.k = k
        self.kv = torch.zeros(spec.n_draft_attn, 2, slots, shape.kv_heads, max_len + k, shape.head_dim,
                              dtype=dtype, **z)
        self.hid = torch.zeros(slots, k + 1, spec.hidden, dtype=dtype, **z)
        self.ctok = torch.zeros(slots, k + 1, dtype=torch.long, **z)
        self.count = torch.ones(slots, dtype=torch.long, **z)
        self.rec_hist = torch.zeros(shape.n_gdn, slots, k, shape.v_heads, shape.k_dim, shape.v_dim,
                                    dtype=state_dtype, **z)
        self.conv_ext = torch.zeros(shape.n_gdn, slots, shape.conv_width + k, shape.conv_dim, dtype=dtype, **z)
        self.seq_stats = torch.zeros(slots, 3, dtype=torch.long, **z)


class SlotCache:
    """Model state and per-slot rows for ``slots`` sequences of up to ``max_len`` tokens each (plus ``spec.k``
    positions of room for a verification's drafts with speculative decoding)."""

    def __init__(self, shape: CacheShape, slots: int, max_len: int, max_new: int, device, dtype,
                 state_dtype=torch.float32, routes: Optional[tuple[int, int]] = None,
                 spec: Optional[SpecShape] = None):
        self.shape, self.slots, self.max_len, self.max_new = shape, slots, max_len, max_new
        z = dict(device=device)
        self.spec = SpecState(spec, shape, slots, max_len, device, dtype, state_dtype) if spec else None
        max_len = max_len + (spec.k if spec else 0)
        self.kv = torch.zeros(shape.n_attn, 2, slots, shape.kv_heads, max_len, shape.head_dim, dtype=dtype, **z)
        self.conv = torch.zeros(shape.n_gdn, slots, shape.conv_width - 1, shape.conv_dim, dtype=dtype, **z)
        self.rec = torch.zeros(shape.n_gdn, slots, shape.v_heads, shape.k_dim, shape.v_dim, dtype=state_dtype, **z)
        # Per-slot rows read and written by the decode step.
        self.tokens = torch.zeros(slots, dtype=torch.long, **z)  # last sampled token (next step's input)
        self.lengths = torch.zeros(slots, dtype=torch.long, **z)  # tokens in the cache = next write position
        self.rope_delta = torch.zeros(slots, dtype=torch.long, **z)  # mRoPE position minus cache position
        self.keys = torch.zeros(slots, dtype=torch.long, **z)  # random stream key
        self.steps = torch.zeros(slots, dtype=torch.long, **z)  # tokens generated so far
        self.limit = torch.zeros(slots, dtype=torch.long, **z)  # max new tokens of the slot's sequence
        self.done = torch.ones(slots, dtype=torch.bool, **z)
        self.out_tokens = torch.zeros(slots, max_new, dtype=torch.long, **z)
        self.out_logprobs = torch.zeros(slots, max_new, dtype=torch.float32, **z)
        # Router replay (rollout.enable_rollout_routing_replay): the experts each cached token was routed to,
        # (slots, max_len, moe_layers, top_k), written by the forwards on the device; -1 = not routed.
        self.routes = None
        if routes is not None:
            self.routes = torch.full((slots, max_len, *routes), -1, dtype=torch.int16, **z)

    def _tensors(self):
        big = [(self.kv, 2), (self.conv, 1), (self.rec, 1)]
        if self.routes is not None:
            big.append((self.routes, 0))
        rows = [self.tokens, self.lengths, self.rope_delta, self.keys, self.steps, self.limit, self.done,
                self.out_tokens, self.out_logprobs]
        if self.spec is not None:  # the verification scratch (rec_hist, conv_ext) lives within one step only
            big.append((self.spec.kv, 2))
            rows += [self.spec.hid, self.spec.ctok, self.spec.count, self.spec.seq_stats]
        return big, rows

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy slots ``src`` onto slots ``dst`` (every state tensor and row)."""
        if not src:
            return
        s = torch.tensor(src, device=self.tokens.device)
        d = torch.tensor(dst, device=self.tokens.device)
        big, rows = self._tensors()
        for t, dim in big:
            t.index_copy_(dim, d, t.index_select(dim, s))
        for t in rows:
            t.index_copy_(0, d, t.index_select(0, s))

    def release(self, slots: list[int]) -> None:
        if slots:
            self.done[torch.tensor(slots, device=self.done.device)] = True
