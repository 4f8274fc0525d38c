"""Qwen3.5 (dense, MoE, VL) forwards for the FSDP actor: packed sequences, padding, Ulysses SP, fused log-probs.

Every text forward runs on one packed row internally:

* packed input ``(1, T)`` with ``attention_mask=None``: sequences start wherever the text position is 0;
* padded input ``(B, L)`` with a 2D ``attention_mask``: the real tokens are gathered into one packed row
  (each row one sequence) and the hidden states scattered back, so pad tokens can never reach real ones;
* unpadded ``(B, L)``: each row is one sequence.

The description of the packed row (:class:`PackedSeqInfo`) is handed explicitly to every decoder layer,
Gated DeltaNet block and attention block, which are all replaced (per instance) by the forwards below and in
``gated_deltanet.py`` / ``packed_attention.py``. Generation with a KV cache falls back to the stock forward.

The causal-LM head's forward is one of three backends (``monkey_patch`` picks): ``forward_with_normal_backend``
(logits, and the MoE load-balancing loss when router logits are asked for), ``forward_with_torch_backend`` and
``forward_with_triton_backend`` (fused per-token log-probs and entropy). The vision tower runs
:func:`vision_forward`, whose position embeddings come from :func:`fast_pos_embed_interpolate` (device-safe under
FSDP2 CPU offload).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers.modeling_outputs import BaseModelOutputWithPast, BaseModelOutputWithPooling, MoeModelOutputWithPast

from verl.models.transformers.fused_forward import _sp_group_if_active, _wants_cache
from verl.models.transformers.packed_attention import PackedSeqInfo, cu_seqlens_from_starts, current_sp_group
from verl.models.transformers.patching import modeling_module
from verl.utils import ulysses as uly

# ----------------------------------------------------------------------------------------------------------------
# Packed-row bookkeeping
# ----------------------------------------------------------------------------------------------------------------


def split_position_ids(
    position_ids: Optional[torch.Tensor], batch: int, length: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise the accepted layouts into (boundary row (B, L), rotary rows (3, B, L)).

    (B, L) text positions; (3, B, L) mRoPE t/h/w; (4, B, L) text + t/h/w. The boundary row is the text row,
    or the temporal row for 3-row mRoPE (it is 0 only at a sequence's first token: chat prompts open with text).
    """
    if position_ids is None:
        position_ids = torch.arange(length, device=device).expand(batch, length)
    if position_ids.dim() == 2:
        return position_ids, position_ids.unsqueeze(0).expand(3, -1, -1)
    if position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    if position_ids.shape[0] == 3:
        return position_ids[0], position_ids
    raise ValueError(f"unsupported position_ids shape {tuple(position_ids.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Ulysses helpers used by the token mixers
# ----------------------------------------------------------------------------------------------------------------


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/sp, H, D) -> (B, T, H/sp, D)."""
    return uly.SeqAllToAll.apply(group, x, 2, 1)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, H/sp, D) -> (B, T/sp, H, D)."""
    return uly.SeqAllToAll.apply(group, x, 1, 2)


def gdn_scatter_heads(module, qkv, beta, g, group):
    """Sequence-sharded GDN projections -> full sequence, this rank's heads (q, k and v heads each split)."""
    b, t, _ = qkv.shape
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    q, k, v = torch.split(qkv, [nk * dk, nk * dk, nv * dv], dim=-1)
    q, k = (seq_to_heads(z.reshape(b, t, nk, dk), group) for z in (q, k))
    v = seq_to_heads(v.reshape(b, t, nv, dv), group)
    full = q.shape[1]
    qkv = torch.cat([q.reshape(b, full, -1), k.reshape(b, full, -1), v.reshape(b, full, -1)], dim=-1)
    beta = seq_to_heads(beta.unsqueeze(-1), group).squeeze(-1)
    g = seq_to_heads(g.unsqueeze(-1), group).squeeze(-1)
    return qkv, beta, g


def gdn_gather_heads(core: torch.Tensor, group) -> torch.Tensor:
    return heads_to_seq(core, group)


def gdn_local_conv_weight(module, group) -> torch.Tensor:
    """(C, W) depthwise conv weight, restricted to this rank's q/k/v channels under Ulysses."""
    weight = module.conv1d.weight.squeeze(1)
    if group is None:
        return weight
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    q_w, k_w, v_w = torch.split(weight, [nk * dk, nk * dk, nv * dv], dim=0)
    pieces = [z.chunk(world, dim=0)[rank] for z in (q_w, k_w, v_w)]
    return torch.cat(pieces, dim=0)


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer and text model
# ----------------------------------------------------------------------------------------------------------------


def decoder_layer_forward(self, hidden_states, position_embeddings=None, packed=None, **kwargs):
    """Pre-norm residual block: token mixer (Gated DeltaNet or gated attention), then the dense or MoE MLP."""
    if kwargs.get("past_key_values") is not None:  # called by the stock model during cached decoding
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings, **kwargs)
    mixed_in = self.input_layernorm(hidden_states)
    if self.block_type == "linear_attention":
        mixed = self.linear_attn(mixed_in, packed=packed)
    else:
        mixed, _ = self.self_attn(mixed_in, position_embeddings=position_embeddings, packed=packed)
    hidden_states = hidden_states + mixed
    mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
    if isinstance(mlp_out, tuple):  # older MoE blocks also return router logits
        mlp_out = mlp_out[0]
    return hidden_states + mlp_out


def _ulysses_row(position_ids, cu_seqlens, local_len: int, device, sp):
    """(rotary rows of this rank's shard, the whole row's PackedSeqInfo) for a sequence-sharded packed row."""
    world, rank = dist.get_world_size(sp), dist.get_rank(sp)
    if position_ids is None:
        raise ValueError("Ulysses sequence parallelism needs position_ids")
    if position_ids.shape[-1] == local_len:  # sliced positions: gather the whole row for the boundaries
        position_ids = uly.all_gather_tensor(position_ids, dim=-1, group=sp)
    if position_ids.shape[-1] != local_len * world:
        raise ValueError(
            f"position_ids length {position_ids.shape[-1]} matches neither {local_len} nor {local_len * world}"
        )
    bound_row, rope_rows = split_position_ids(position_ids, 1, local_len * world, device)
    if cu_seqlens is None:
        cu, max_len = cu_seqlens_from_starts(bound_row[0] == 0)
    else:
        cu, max_len = cu_seqlens.to(device=device, dtype=torch.int32), int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    rope_rows = rope_rows[..., rank * local_len : (rank + 1) * local_len]
    return rope_rows, PackedSeqInfo(cu, max_len, sp)


def text_model_forward(
    self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, cu_seqlens=None, **kwargs
):
    """Replacement for Qwen3_5TextModel.forward / Qwen3_5MoeTextModel.forward (see module docstring).

    ``cu_seqlens`` may be given explicitly for a packed (1, T) row to override the position-derived boundaries.
    """
    if _wants_cache(kwargs):  # incremental decoding needs the cache-aware stock path
        named = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return type(self).forward(self, position_ids=position_ids, **named, **kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    batch, local_len, hidden = inputs_embeds.shape
    device = inputs_embeds.device
    sp = _sp_group_if_active()

    if sp is not None:
        if batch != 1:
            raise ValueError("Ulysses sequence parallelism expects a packed (1, T/sp) row")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("Ulysses sequence parallelism needs remove-padding inputs (attention_mask=None)")
        rope_rows, packed = _ulysses_row(position_ids, cu_seqlens, local_len, device, sp)
        hidden_states, index = inputs_embeds, None
    else:
        bound_row, rope_rows = split_position_ids(position_ids, batch, local_len, device)
        row_start = torch.zeros(batch, local_len, dtype=torch.bool, device=device)
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            keep = attention_mask.bool()
            # First real token of every row starts a sequence, whatever its position id.
            first = keep & (keep.long().cumsum(-1) == 1)
            index = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
            starts = (first | (bound_row == 0)).flatten()[index]
        else:
            index = None
            row_start[:, 0] = True
            starts = (row_start | (bound_row == 0)).flatten()
        if cu_seqlens is not None and batch == 1 and index is None:
            cu = cu_seqlens.to(device=device, dtype=torch.int32)
            max_len = int((cu[1:] - cu[:-1]).max())
        else:
            cu, max_len = cu_seqlens_from_starts(starts)
        flat = inputs_embeds.reshape(batch * local_len, hidden)
        rope_flat = rope_rows.reshape(3, batch * local_len)
        if index is not None:
            flat, rope_flat = flat.index_select(0, index), rope_flat.index_select(1, index)
        hidden_states = flat.unsqueeze(0)
        rope_rows = rope_flat.unsqueeze(1)
        packed = PackedSeqInfo(cu, max_len, None)

    position_embeddings = self.rotary_emb(hidden_states, rope_rows)
    with recording_router_logits(self, bool(kwargs.get("output_router_logits"))) as router_logits:
        for layer in self.layers[: self.config.num_hidden_layers]:
            # hidden_states positional: HF's reentrant checkpointing only tracks grads of positional tensors.
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, packed=packed)
    hidden_states = self.norm(hidden_states)

    if sp is None:
        if index is not None:
            full = hidden_states.new_zeros(batch * local_len, hidden)
            hidden_states = full.index_copy(0, index, hidden_states[0])
        hidden_states = hidden_states.reshape(batch, local_len, hidden)
    if "moe" in modeling_module(self).__name__:
        routers = None if router_logits is None else tuple(router_logits)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, router_logits=routers)
    return BaseModelOutputWithPast(last_hidden_state=hidden_states)


@contextlib.contextmanager
def recording_router_logits(text_model, wanted: bool):
    """Collect every MoE router's logits during the layer loop (what the stock model's output recorder gathers
    for the load-balancing loss): yields the list they are appended to, or None when not wanted or dense.

    The routers see the packed real tokens only (pads never reach them), so the loss needs no attention mask."""
    recorder = (getattr(type(text_model), "_can_record_outputs", None) or {}).get("router_logits")
    if not wanted or recorder is None:
        yield None
        return
    record: list = []

    def keep(module, args, output):
        record.append(output[recorder.index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(keep) for m in text_model.modules() if isinstance(m, recorder.target_class)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------------------------------------------
# Vision-language wrapper
# ----------------------------------------------------------------------------------------------------------------


def _dummy_vision_forward(vl_model, like: torch.Tensor) -> torch.Tensor:
    """Run the vision tower on one tiny blank image and return a zero that depends on every vision weight.

    With FSDP every rank must run the same collectives: a rank whose micro-batch has no image would otherwise
    skip the vision tower's all-gathers (hang) and produce no gradients for it.
    """
    vcfg = vl_model.config.vision_config
    m = vcfg.spatial_merge_size
    grid = torch.tensor([[1, m, m]], device=like.device)
    patch = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    pixels = torch.zeros(m * m, patch, device=like.device, dtype=like.dtype)
    feats = vl_model.visual(pixels, grid_thw=grid)
    pooled = feats.pooler_output if hasattr(feats, "pooler_output") else feats[1]
    return pooled.sum().to(like.dtype) * 0.0


def _vision_embeds(vl_model, pixel_values, grid_thw):
    feats = vl_model.get_image_features(pixel_values, grid_thw)
    pooled = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    if isinstance(pooled, (list, tuple)):
        pooled = torch.cat(list(pooled), dim=0)
    return pooled


def _default_mrope_positions(vl_model, input_ids, attention_mask, grids, mm_token_type_ids):
    """Positions when the caller gave none: mRoPE from the image/video grids, else plain per-row counters."""
    image_grid_thw, video_grid_thw = grids
    if image_grid_thw is None and video_grid_thw is None:
        return None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if mm_token_type_ids is None:
        cfg = vl_model.config
        mm_token_type_ids = (input_ids == cfg.image_token_id).long() + 2 * (input_ids == cfg.video_token_id).long()
    rope_kwargs = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw, "attention_mask": attention_mask}
    return vl_model.get_rope_index(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, **rope_kwargs)[0]


def vl_model_forward(
    self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, cu_seqlens=None, **kwargs
):
    """Replacement for Qwen3_5Model.forward / Qwen3_5MoeModel.forward (image + text merge, then the text model).

    Multimodal inputs arrive in ``kwargs`` (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
    mm_token_type_ids). Under Ulysses the caller passes the full (padded) row of input_ids/positions: the
    placeholders must be filled on the whole row, then each rank keeps its slice of the embeddings.
    """
    if _wants_cache(kwargs):
        named = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return type(self).forward(self, position_ids=position_ids, **named, **kwargs)
    image_grid_thw, video_grid_thw = kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    saw_vision = False
    for pixels, grid, token_id in (
        (kwargs.get("pixel_values"), image_grid_thw, self.config.image_token_id),
        (kwargs.get("pixel_values_videos"), video_grid_thw, self.config.video_token_id),
    ):
        if pixels is None:
            continue
        saw_vision = True
        feats = _vision_embeds(self, pixels, grid).to(inputs_embeds.device, inputs_embeds.dtype)
        slots = (input_ids == token_id).unsqueeze(-1)
        if int(slots.sum()) != feats.shape[0]:
            raise ValueError(f"{int(slots.sum())} placeholder tokens for {feats.shape[0]} vision embeddings")
        inputs_embeds = inputs_embeds.masked_scatter(slots.expand_as(inputs_embeds), feats)
    if not saw_vision and (torch.is_grad_enabled() or dist.is_initialized()):
        inputs_embeds = inputs_embeds + _dummy_vision_forward(self, inputs_embeds)
    if position_ids is None:
        grids = (image_grid_thw, video_grid_thw)
        position_ids = _default_mrope_positions(self, input_ids, attention_mask, grids, kwargs.get("mm_token_type_ids"))

    sp = _sp_group_if_active()
    if sp is not None:
        if inputs_embeds.shape[1] % dist.get_world_size(sp) != 0:
            raise ValueError("pad the packed row to a multiple of the SP size (ulysses_pad) before the forward")
        inputs_embeds = uly.slice_input_tensor(inputs_embeds, dim=1, padding=False, group=sp)

    lm_inputs = {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "position_ids": position_ids}
    routers = {"output_router_logits": True} if kwargs.get("output_router_logits") else {}
    lm_out = self.language_model(use_cache=False, cu_seqlens=cu_seqlens, **lm_inputs, **routers)
    out_mod = modeling_module(self)
    moe_cls = getattr(out_mod, "Qwen3_5MoeModelOutputWithPast", None)
    if moe_cls is not None:
        return moe_cls(last_hidden_state=lm_out.last_hidden_state, router_logits=lm_out.router_logits)
    return out_mod.Qwen3_5ModelOutputWithPast(last_hidden_state=lm_out.last_hidden_state)


# ----------------------------------------------------------------------------------------------------------------
# Vision position-embedding interpolation (device-safe under FSDP2 CPU offload)
# ----------------------------------------------------------------------------------------------------------------


def _axis_taps(n: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear, align_corners=True sampling of ``n`` points from a ``side``-long axis: (lo, hi, frac)."""
    if n > 1:
        coord = torch.linspace(0, side - 1, n, device=device, dtype=torch.float32)
    else:
        coord = torch.zeros(1, device=device)
    lo = coord.floor().long().clamp(max=side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    return lo, hi, coord - lo.float()


def vision_interp_indices_weights(
    grid_thw: torch.Tensor, side: int, merge: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 4) indices into the flattened ``side x side`` table and (N, 4) bilinear weights, in the vision
    tower's patch order (t, block_row, block_col, in_row, in_col). Built on ``device`` (the input's)."""
    all_idx, all_w = [], []
    for t, h, w in grid_thw.tolist():
        r_lo, r_hi, r_f = _axis_taps(h, side, device)
        c_lo, c_hi, c_f = _axis_taps(w, side, device)
        idx = torch.stack(
            [
                r_lo[:, None] * side + c_lo[None, :],
                r_lo[:, None] * side + c_hi[None, :],
                r_hi[:, None] * side + c_lo[None, :],
                r_hi[:, None] * side + c_hi[None, :],
            ],
            dim=-1,
        )  # (h, w, 4)
        wts = torch.stack(
            [
                (1 - r_f)[:, None] * (1 - c_f)[None, :],
                (1 - r_f)[:, None] * c_f[None, :],
                r_f[:, None] * (1 - c_f)[None, :],
                r_f[:, None] * c_f[None, :],
            ],
            dim=-1,
        )

        def to_merge_order(x):
            x = x.reshape(h // merge, merge, w // merge, merge, 4).permute(0, 2, 1, 3, 4).reshape(h * w, 4)
            return x.repeat(t, 1)

        all_idx.append(to_merge_order(idx))
        all_w.append(to_merge_order(wts))
    return torch.cat(all_idx), torch.cat(all_w)


def fast_pos_embed_interpolate(visual, grid_thw: torch.Tensor, device=None) -> torch.Tensor:
    """Interpolated learned position embeddings (N, C) for every patch of ``grid_thw``.

    Indices and weights are built on ``device`` (default: grid_thw's), never on the embedding weight's device,
    and the table is read through ``visual.pos_embed(...)`` so FSDP2's hooks unshard it (no DTensor access).
    """
    mode = (getattr(visual, "interpolation_mode", "bilinear"), getattr(visual, "interpolation_align_corners", True))
    if mode != ("bilinear", True):
        raise NotImplementedError(f"vision position embeddings resampled with (mode, align_corners)={mode}; only "
                                  "bilinear with align_corners=True (Qwen3.5's) is implemented")
    device = grid_thw.device if device is None else device
    side = visual.num_grid_per_side
    idx, wts = vision_interp_indices_weights(grid_thw, side, visual.spatial_merge_size, device)
    emb = visual.pos_embed(idx)  # (N, 4, C)
    return (emb * wts[..., None].to(emb.dtype)).sum(1)


def vision_forward(self, hidden_states, grid_thw, **kwargs):
    """Replacement for Qwen3_5VisionModel.forward / Qwen3_5MoeVisionModel.forward: the stock vision tower, with
    its learned position embeddings from :func:`fast_pos_embed_interpolate` on the pixels' device.

    The stock forward builds its interpolation indices (and rotary positions and attention boundaries) on
    ``grid_thw``'s device, which processors leave on the CPU; under FSDP2 CPU offload the table it reads is
    unsharded on the GPU, so the lookup mixes devices. Here everything derived from ``grid_thw`` lives where the
    pixels are, and the table is read through the module call FSDP2 hooks.
    """
    from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

    device = hidden_states.device
    grid_thw = grid_thw.to(device)
    position_ids = get_vision_position_ids(grid_thw, self.spatial_merge_size, kwargs=kwargs)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, self.config, kwargs=kwargs)
    for key in ("interp_indices", "interp_weights"):  # precomputed lookups of the stock path: ours replace them
        kwargs.pop(key, None)
    hidden_states = self.patch_embed(hidden_states)
    pos_embeds = fast_pos_embed_interpolate(self, grid_thw, device)
    hidden_states = hidden_states + pos_embeds.to(hidden_states.dtype)
    position_embeddings = self.rotary_pos_emb(hidden_states, position_ids)
    hidden_states = hidden_states.reshape(hidden_states.shape[0], -1)
    for block in self.blocks:
        hidden_states = block(hidden_states, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              position_embeddings=position_embeddings, **kwargs)
    return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=self.merger(hidden_states))
