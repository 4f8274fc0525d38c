"""Qwen3.5 (dense, MoE, VL) forwards for generation: packed prefill into slots, and one batched decode step.

Both run the model's own submodules (projections, norms, rotary table, MLP / MoE, LM head) with this module's
layer wiring, because generation needs what the training forwards never return: each sequence's final Gated
DeltaNet conv and recurrent states and its attention keys/values.

* Prefill packs the prompts into one ``(1, T)`` row described by ``cu_seqlens``, with the same kernels as the
  training path (``gated_deltanet.causal_conv1d``, the chunked gated delta rule, ``varlen_causal_attention``),
  so prompts of different lengths cost no padding. A prompt can fill several slots (the n samples of a prompt
  share one prefill).
* Decode runs one token for slots ``[:b]``: the conv window from the cached inputs, one gated-delta-rule step
  (fla's fused recurrent kernel updating the state in place on CUDA, the torch reference elsewhere), attention
  over the slot's cached keys, then sampling and the per-slot bookkeeping, all on the device with no host sync,
  so the whole step can be captured as a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from verl.models.qwen3_5 import gated_deltanet as gdn
from verl.models.qwen3_5.hf_spec import Qwen35SpecForwards
from verl.models.transformers.packed_attention import varlen_causal_attention
from verl.models.transformers.patching import modeling_module
from verl.workers.rollout.hf_engine.cache import CacheShape, SlotCache
from verl.workers.rollout.hf_engine.runner import PrefillSeq

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _fla_recurrent_kernel():
    """fla's fused recurrent gated-delta-rule kernel (the jitted function), or None without fla."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent as fr

        return fr.fused_recurrent_gated_delta_rule_fwd_kernel, fr.fused_recurrent_gated_delta_rule
    except Exception:
        return None


def fla_recurrent_step_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for every row, updating ``state`` (B, HV, K, V) in place.

    Calls fla's kernel with the state as both its initial and final state: each program reads its state block
    once and writes the same block back, so the state costs one read and one write per token (fla's public
    wrapper would allocate a fresh fp32 final state and need a copy back). q/k: (B, 1, H, K), v: (B, 1, HV, V),
    g/beta: (B, 1, HV); q/k are L2-normalised in the kernel.
    """
    import triton

    kernel, _ = _fla_recurrent_kernel()
    b, t, h, dk = k.shape
    hv, dv = v.shape[2], v.shape[-1]
    bk, bv = triton.next_power_of_2(dk), min(8, triton.next_power_of_2(dv))
    out = torch.empty_like(v)
    kernel[(triton.cdiv(dv, bv) * b * hv,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=out, h0=state, ht=state,
        cu_seqlens=None, scale=dk**-0.5, T=t, H=h, HV=hv, K=dk, V=dv, BK=bk, BV=bv, IS_BETA_HEADWISE=True,
        USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False,
        num_warps=1, num_stages=3,
    )
    return out


@functools.lru_cache(maxsize=None)
def _warn_torch_step():
    logger.warning("hf rollout: no fused gated-delta-rule decode kernel (triton / fla) on CUDA; decoding runs the "
                   "torch reference step, several times slower")


def torch_recurrent_step_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`fla_recurrent_step_` (same layouts), in fp32."""
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k = gdn.l2_normalize(q.float()), gdn.l2_normalize(k.float())
    out, new = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    state.copy_(new.to(state.dtype))
    return out.to(v.dtype)


def _rule_with_final_state(q, k, v, g, beta, cu, max_len):
    """Packed gated delta rule from zero states, also returning each sequence's final state (N, HV, K, V)."""
    if gdn.use_fla(q.device):
        rule = gdn._fla_functions()[1]
        return rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                    cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
    q, k = gdn.l2_normalize(q.float()), gdn.l2_normalize(k.float())
    # Right-padded rows: pad slots have k = 0 and beta = 0, so they leave each row's final state untouched.
    rows, index = zip(*(gdn.packed_to_batch(z[0], cu, max_len) for z in (q, k, v, g, beta)))
    out, final = gdn.chunked_gated_delta_rule(*rows, chunk_size=min(64, max(16, max_len)))
    return gdn.batch_to_packed(out, index[0]).unsqueeze(0).to(v.dtype), final


# transformers' expert implementations that route on the device (a sort, a histogram and grouped / batched
# GEMMs over every expert) with no data-dependent shapes or host syncs, so a decode step can be a CUDA graph.
# "eager" loops over the experts hit (a host sync per layer); other kernels are not known to be capturable.
SYNC_FREE_EXPERTS = ("grouped_mm", "batched_mm")
# torch's fused grouped GEMM takes bf16 only: for another dtype ATen falls back to a loop over the groups that
# reads the offsets on the host, which fails inside a CUDA graph capture (seen on an H100 with fp32 experts).
GROUPED_MM_DTYPES = (torch.bfloat16,)


def _moe_sync_free(module: torch.nn.Module, layers) -> bool:
    if hasattr(module, "get_base_model"):
        return False  # PEFT's wrappers around the 3-D expert weights run their own (unaudited) forward
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        if impl not in SYNC_FREE_EXPERTS:
            return False
        weight = next(experts.parameters(), None)
        if impl == "grouped_mm" and weight is not None and weight.dtype not in GROUPED_MM_DTYPES:
            return False
    return True


class Qwen35Runner(Qwen35SpecForwards):
    """Generation forwards over a (possibly FSDP2-unsharded) Qwen3.5 causal LM or VL model (speculative decoding
    with the MTP head: :class:`verl.models.qwen3_5.hf_spec.Qwen35SpecForwards`)."""

    def __init__(self, module: torch.nn.Module, recurrent_backend: str = "auto"):
        self.module = module
        # A PEFT model wraps the HF model; its LoRA layers sit inside it, so calling the submodules applies them.
        if hasattr(module, "get_base_model"):
            module = module.get_base_model()
        self._hf = module  # the HF model: ``model.mtp`` is the MTP head when one is attached
        inner = module.model
        self.vl = inner if hasattr(inner, "language_model") else None
        self.text = inner.language_model if self.vl is not None else inner
        self.lm_head = module.lm_head
        self.cfg = self.text.config
        self.layers = list(self.text.layers[: self.cfg.num_hidden_layers])
        self.types = list(self.cfg.layer_types[: self.cfg.num_hidden_layers])
        self.shape = CacheShape.from_text_config(self.cfg)
        self.is_moe = any(hasattr(layer.mlp, "experts") for layer in self.layers)
        self.syncs_host = self.is_moe and not _moe_sync_free(self.module, self.layers)
        attn = next(layer.self_attn for layer, t in zip(self.layers, self.types) if t == "full_attention")
        # The rotary helper of the model's modeling file, named by its spec: the module's runtime class may be
        # FSDP2's wrapper subclass (a wrap policy by size or class wraps the attention modules themselves).
        self._rotary = modeling_module(attn).apply_rotary_pos_emb
        self.recurrent_backend = recurrent_backend
        self.tape = None  # RouterTape when the rollout records MoE routes (enable_rollout_routing_replay)
        self.route_shape: Optional[tuple[int, int]] = None

    def record_routes(self, tape) -> None:
        """Have the forwards write each token's experts into ``cache.routes`` (see ``router_replay``)."""
        self.tape, self.route_shape = tape, tape.shape

    def _routes_to(self, cache: SlotCache, slot: torch.Tensor, pos: torch.Tensor, src: Optional[torch.Tensor]):
        """A recording context whose sink scatters MoE layer ``li``'s indices of the forward's tokens ``src``
        (all of them when None) to ``cache.routes[slot, pos, li]``: device-side index writes only, so the decode
        step keeps no host sync and stays capturable."""
        if self.tape is None or cache.routes is None:
            return contextlib.nullcontext()

        def sink(li: int, indices: torch.Tensor) -> None:
            rows = indices if src is None else indices.index_select(0, src)
            cache.routes[slot, pos, li] = rows.to(cache.routes.dtype)

        return self.tape.recording(sink)

    @property
    def device(self) -> torch.device:
        return self.text.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.embed_tokens.weight.dtype

    def recurrent_step(self) -> Callable:
        """The one-token gated-delta-rule step: ``auto`` picks this package's Triton kernel on CUDA (fla's
        fused recurrent kernel where it does not fit the head dims), the torch reference elsewhere."""
        backend = self.recurrent_backend
        if self.device.type != "cuda" or backend == "torch":
            return torch_recurrent_step_
        if backend in ("auto", "triton"):
            try:
                from verl.models.qwen3_5 import decode_kernels as kern
            except ImportError:
                kern = None
            if kern is not None and kern.supports(self.shape.k_dim, self.shape.v_dim):
                return kern.gdn_decode_step_
            if backend == "triton":
                raise RuntimeError("engine_kwargs.hf.recurrent_backend=triton needs triton and power-of-two "
                                   "key dims / value dims divisible by 32")
        if _fla_recurrent_kernel() is not None and gdn.use_fla(self.device):
            return fla_recurrent_step_
        if backend == "fla":
            raise RuntimeError("engine_kwargs.hf.recurrent_backend=fla needs fla (pip install flash-linear-attention)")
        _warn_torch_step()
        return torch_recurrent_step_

    def fused_kernels(self):
        """This package's Triton decode kernels (``decode_kernels``) when the recurrent backend resolves to
        them: the decode step then also runs its norms, conv window and gates fused. None otherwise."""
        step = self.recurrent_step()
        if step is torch_recurrent_step_ or step is fla_recurrent_step_:
            return None
        from verl.models.qwen3_5 import decode_kernels

        return decode_kernels

    # ------------------------------------------------------------------------------------------ shared parts
    def _mlp(self, layer, h):
        out = layer.mlp(layer.post_attention_layernorm(h))
        return out[0] if isinstance(out, tuple) else out

    def _gates(self, m, x):
        beta = m.in_proj_b(x).sigmoid()
        # Decay in log space, kept in fp32 (as in training: A_log.exp() overflows half precision).
        g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias.float())
        return beta, g

    def _qkv_heads(self, m, mixed, b, t):
        nk, nv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
        return q.reshape(b, t, nk, dk), k.reshape(b, t, nk, dk), v.reshape(b, t, nv, dv)

    def _attn_qkv(self, m, x, cos, sin, kern=None):
        b, t, _ = x.shape
        hd = m.head_dim
        q_and_gate = m.q_proj(x).view(b, t, -1, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
        k = m.k_proj(x).view(b, t, -1, hd)
        if kern is None:
            q, k = m.q_norm(q), m.k_norm(k)
        else:
            q = kern.add_rms_norm(q, None, m.q_norm.weight, m.q_norm.eps)[1]
            k = kern.add_rms_norm(k, None, m.k_norm.weight, m.k_norm.eps)[1]
        v = m.v_proj(x).view(b, t, -1, hd)
        q, k = self._rotary(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v, gate.reshape(b, t, -1)

    # ------------------------------------------------------------------------------------------ prefill
    def embed_prompt(self, seq: PrefillSeq) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings (L, H), rotary positions (3, L)) of one prompt; images and videos are encoded here (VL
        models)."""
        ids = torch.tensor(seq.ids, dtype=torch.long, device=self.device)
        emb = self.text.embed_tokens(ids)
        pos = torch.arange(len(seq.ids), device=self.device).expand(3, -1)
        mm = seq.mm or {}
        if self.vl is None or (mm.get("pixel_values") is None and mm.get("pixel_values_videos") is None):
            return emb, pos
        from verl.models.qwen3_5.hf_forward import _default_mrope_positions, _vision_embeds

        grids = []
        for pixels_key, grid_key, token_id in (("pixel_values", "image_grid_thw", self.vl.config.image_token_id),
                                               ("pixel_values_videos", "video_grid_thw",
                                                self.vl.config.video_token_id)):
            if mm.get(pixels_key) is None:
                grids.append(None)
                continue
            grid = mm[grid_key].to(self.device)
            grids.append(grid)
            feats = _vision_embeds(self.vl, mm[pixels_key].to(self.device, self.dtype), grid).to(emb.dtype)
            slots = ids == token_id
            if int(slots.sum()) != feats.shape[0]:
                raise ValueError(f"{int(slots.sum())} {pixels_key} placeholder tokens for {feats.shape[0]} "
                                 "vision embeddings")
            emb = emb.masked_scatter(slots[:, None].expand_as(emb), feats)
        pos = _default_mrope_positions(self.vl, ids[None], None, tuple(grids), None)
        return emb, pos[:, 0].to(self.device)

    @torch.no_grad()
    def prefill(self, cache: SlotCache, seqs: list[PrefillSeq], targets: list[list[int]]) -> torch.Tensor:
        """Run the prompts as one packed row, write their states into ``targets[i]`` (slots of prompt i) and
        set those slots' lengths and rope deltas. Returns the last-token logits (len(seqs), V)."""
        dev = self.device
        embeds, positions = zip(*(self.embed_prompt(s) for s in seqs))
        lens = [e.shape[0] for e in embeds]
        x = torch.cat(embeds)[None]
        rope = torch.cat(positions, dim=-1)[:, None]  # (3, 1, T)
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        max_len = max(lens)
        cos, sin = self.text.rotary_emb(x, rope)

        # Where every target slot's state comes from.
        slot_t = torch.tensor([s for ts in targets for s in ts], device=dev)
        src_t = torch.tensor([i for i, ts in enumerate(targets) for _ in ts], device=dev)
        # Token-level copy plan for the KV cache: (slot, position, packed token index) per cached token.
        plan = [(s, i) for i, ts in enumerate(targets) for s in ts]
        kv_slot = torch.cat([torch.full((lens[i],), s, device=dev) for s, i in plan])
        kv_pos = torch.cat([torch.arange(lens[i], device=dev) for _, i in plan])
        kv_src = torch.cat([torch.arange(lens[i], device=dev) + int(sum(lens[:i])) for _, i in plan])

        h = x
        n_attn = n_gdn = 0
        with self._routes_to(cache, kv_slot, kv_pos, kv_src):  # every prompt token, into each of its slots
            for layer, kind in zip(self.layers, self.types):
                r = layer.input_layernorm(h)
                if kind == "linear_attention":
                    mixed = self._gdn_prefill(layer.linear_attn, r, cu, max_len, cache, n_gdn, slot_t, src_t)
                    n_gdn += 1
                else:
                    mixed = self._attn_prefill(layer.self_attn, r, cos, sin, cu, max_len, cache, n_attn,
                                               kv_slot, kv_pos, kv_src)
                    n_attn += 1
                h = h + mixed
                h = h + self._mlp(layer, h)
        if cache.spec is not None:  # speculative decoding: the drafter's cache over the prompts
            ids = torch.tensor([t for s in seqs for t in s.ids], device=dev)
            normed = self.text.norm(h[0])
            self.mtp_prefill(cache, normed, ids, rope, lens, targets)
            last = normed[cu[1:].long() - 1]
        else:
            last = self.text.norm(h[0, cu[1:].long() - 1])
        lengths = torch.tensor(lens, device=dev)
        deltas = torch.stack([p.max() + 1 - p.shape[-1] for p in positions])
        cache.lengths[slot_t] = lengths[src_t]
        cache.rope_delta[slot_t] = deltas[src_t]
        return self.lm_head(last)

    def _gdn_prefill(self, m, x, cu, max_len, cache, li, slot_t, src_t):
        _, t, _ = x.shape
        qkv = m.in_proj_qkv(x)
        z = m.in_proj_z(x)
        beta, g = self._gates(m, x)
        bias = m.conv1d.bias
        mixed = gdn.causal_conv1d(qkv, m.conv1d.weight.squeeze(1), bias, cu, "silu")
        # Conv state: each sequence's last (width - 1) pre-conv inputs, zeros before its start.
        w1 = cache.shape.conv_width - 1
        starts, ends = cu[:-1].long(), cu[1:].long()
        idx = ends[:, None] - w1 + torch.arange(w1, device=x.device)
        window = qkv[0, idx.clamp(min=0)] * (idx >= starts[:, None])[..., None].to(qkv.dtype)
        cache.conv[li].index_copy_(0, slot_t, window.index_select(0, src_t).to(cache.conv.dtype))
        q, k, v = self._qkv_heads(m, mixed, 1, t)
        if m.num_v_heads != m.num_k_heads:  # grouped value heads, as in training
            rep = m.num_v_heads // m.num_k_heads
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        core, final = _rule_with_final_state(q, k, v, g, beta, cu, max_len)
        cache.rec[li].index_copy_(0, slot_t, final.index_select(0, src_t).to(cache.rec.dtype))
        dv = m.head_v_dim
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, t, -1)
        return m.out_proj(core)

    def _attn_prefill(self, m, x, cos, sin, cu, max_len, cache, li, kv_slot, kv_pos, kv_src):
        _, t, _ = x.shape
        q, k, v, gate = self._attn_qkv(m, x, cos, sin)
        out = varlen_causal_attention(q[0], k[0], v[0], cu, max_len, m.scaling)
        heads = torch.arange(k.shape[2], device=x.device)
        index = (kv_slot[:, None], heads[None, :], kv_pos[:, None])
        cache.kv[li, 0].index_put_(index, k[0].index_select(0, kv_src).to(cache.kv.dtype))
        cache.kv[li, 1].index_put_(index, v[0].index_select(0, kv_src).to(cache.kv.dtype))
        out = out.reshape(1, t, -1) * torch.sigmoid(gate)
        return m.o_proj(out)

    # ------------------------------------------------------------------------------------------ decode
    def decode_logits(self, cache: SlotCache, b: int) -> torch.Tensor:
        """Logits (b, V) of the next token for slots [:b]; appends the input token's K/V and updates states."""
        tokens = cache.tokens[:b]
        pos = cache.lengths[:b]
        h = self.text.embed_tokens(tokens)[:, None]
        rope = (pos + cache.rope_delta[:b])[None, :, None].expand(3, b, 1)
        cos, sin = self.text.rotary_emb(h, rope)
        # the input token sits at position ``pos`` of its slot; its routes go there
        with self._routes_to(cache, torch.arange(b, device=pos.device), pos, None):
            return self._decode_layers(cache, b, h, cos, sin, pos)

    def _decode_layers(self, cache, b, h, cos, sin, pos):
        kern = self.fused_kernels()
        if kern is not None:
            return self._decode_fused(cache, b, h, cos, sin, pos, kern)
        step = self.recurrent_step()
        h = self._layer_stack(
            h, lambda m, r, i: self._gdn_decode(m, r, cache, i, b, step),
            lambda m, r, i: self._attn_decode(m, r, cos, sin, cache, i, b, pos))
        return self.lm_head(self.text.norm(h[:, 0]))

    def _layer_stack(self, h, gdn, attn):
        """The decoder layers over ``h`` with the step's mixers: ``gdn(module, normed, i)`` for the i-th Gated
        DeltaNet layer, ``attn(module, normed, i)`` for the i-th attention layer (plain decode and speculative
        verification differ only there)."""
        n_attn = n_gdn = 0
        for layer, kind in zip(self.layers, self.types):
            r = layer.input_layernorm(h)
            if kind == "linear_attention":
                h = h + gdn(layer.linear_attn, r, n_gdn)
                n_gdn += 1
            else:
                h = h + attn(layer.self_attn, r, n_attn)
                n_attn += 1
            h = h + self._mlp(layer, h)
        return h

    def _decode_fused(self, cache, b, h, cos, sin, pos, kern):
        """:meth:`decode_logits` with the Triton kernels: each residual add runs fused with the next norm, the
        conv window, gates and delta rule of a Gated DeltaNet layer take three kernels, its output norm one."""
        nxt = [layer.input_layernorm for layer in self.layers[1:]] + [self.text.norm]
        first = self.layers[0].input_layernorm
        _, r = kern.add_rms_norm(h, None, first.weight, first.eps)
        n_attn = n_gdn = 0
        for layer, kind, norm in zip(self.layers, self.types, nxt):
            if kind == "linear_attention":
                mixed = self._gdn_decode_fused(layer.linear_attn, r, cache, n_gdn, b, kern)
                n_gdn += 1
            else:
                mixed = self._attn_decode(layer.self_attn, r, cos, sin, cache, n_attn, b, pos, kern)
                n_attn += 1
            post = layer.post_attention_layernorm
            h, r = kern.add_rms_norm(h, mixed, post.weight, post.eps)
            out = layer.mlp(r)
            h, r = kern.add_rms_norm(h, out[0] if isinstance(out, tuple) else out, norm.weight, norm.eps)
        return self.lm_head(r[:, 0])

    def _gdn_decode_fused(self, m, x, cache, li, b, kern):
        qkv = m.in_proj_qkv(x)[:, 0]  # (b, C)
        z = m.in_proj_z(x)
        a, beta_raw = m.in_proj_a(x)[:, 0], m.in_proj_b(x)[:, 0]  # (b, HV): gates are computed in the kernel
        mixed = kern.conv_step_(qkv, cache.conv[li, :b], m.conv1d.weight.contiguous(), m.conv1d.bias)
        core = kern.gdn_decode_fused_(mixed, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, a,
                                      beta_raw, m.A_log, m.dt_bias, cache.rec[li, :b])
        core = kern.gated_rms_norm(core, z.reshape(core.shape), m.norm.weight, m.norm.variance_epsilon)
        return m.out_proj(core.reshape(b, 1, -1))

    def _gdn_decode(self, m, x, cache, li, b, step: Callable):
        qkv = m.in_proj_qkv(x)  # (b, 1, C)
        z = m.in_proj_z(x)
        beta, g = self._gates(m, x)
        conv_state = cache.conv[li, :b]
        window = torch.cat([conv_state, qkv.to(conv_state.dtype)], dim=1)  # (b, W, C)
        weight = m.conv1d.weight.squeeze(1)  # (C, W)
        mixed = (window.to(weight.dtype) * weight.t()[None]).sum(1, keepdim=True)
        if m.conv1d.bias is not None:
            mixed = mixed + m.conv1d.bias
        mixed = F.silu(mixed).to(qkv.dtype)
        conv_state.copy_(window[:, 1:])
        q, k, v = self._qkv_heads(m, mixed, b, 1)
        core = step(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                    cache.rec[li, :b])
        dv = m.head_v_dim
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, 1, -1)
        return m.out_proj(core)

    def _attn_decode(self, m, x, cos, sin, cache, li, b, pos, kern=None):
        q, k, v, gate = self._attn_qkv(m, x, cos, sin, kern)  # q: (b, 1, Hq, D), k/v: (b, 1, Hkv, D)
        kc, vc = cache.kv[li, 0, :b], cache.kv[li, 1, :b]  # (b, Hkv, L, D)
        hkv, length = kc.shape[1], kc.shape[2]
        rows = torch.arange(b, device=x.device)
        heads = torch.arange(hkv, device=x.device)
        index = (rows[:, None], heads[None, :], pos[:, None])
        kc.index_put_(index, k[:, 0].to(kc.dtype))
        vc.index_put_(index, v[:, 0].to(vc.dtype))
        if kern is not None and kern.attention_supported(q.shape[-1]):  # reads only the visible keys
            out = kern.decode_attention(q[:, 0].contiguous(), kc, vc, pos, m.scaling).reshape(b, 1, -1)
            return m.o_proj(out * torch.sigmoid(gate))
        # Grouped-query attention of one query token over the slot's cache, keys up to its own position.
        qg = q[:, 0].reshape(b, hkv, -1, q.shape[-1])  # (b, Hkv, G, D)
        scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * m.scaling  # (b, Hkv, G, L)
        visible = torch.arange(length, device=x.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vc.dtype)
        out = torch.matmul(probs, vc).reshape(b, 1, -1)  # (b, 1, Hq * D)
        out = out * torch.sigmoid(gate)
        return m.o_proj(out)
