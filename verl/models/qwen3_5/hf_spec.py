"""Speculative-decoding forwards of the Qwen3.5 decode runner: drafting with the checkpoint's MTP head and
verifying k + 1 tokens per sequence in one target forward (:mod:`verl.workers.rollout.hf_engine.speculative`
drives them).

Drafter (``model.mtp``, one full-attention decoder layer, :mod:`verl.models.qwen3_5.mtp`): at position t it reads
the target's final (normed) hidden state ``h[t]`` and the embedding of token ``t + 1`` and predicts token ``t + 2``,
exactly as it is trained. Its attention has its own KV cache (``SpecState.kv``), kept equal to what a forward over
the whole accepted sequence would hold: prefill fills the prompt's positions, and each step first *catches up* on
the positions whose target hidden states the last verification produced (1 .. k + 1 of them, the accepted tokens
and the pending one), whose output at the last position gives draft 1. Drafts 2 .. k reuse the same layer on its
own output (vLLM's multi-step MTP); their cache entries are provisional and the next catch-up rewrites them.

Verification runs the main stack over ``[pending token, draft 1 .. draft k]`` at positions ``lengths ..``. The
attention KV cache rewinds for free (entries past the accepted length are masked, then overwritten). Gated
DeltaNet's conv window and recurrent state do not: we KEEP the per-position states of the verification forward
(the recurrent state after each of its first k tokens in ``rec_hist``, the conv window extended by all k + 1 inputs
in ``conv_ext``) and :meth:`rewind` selects the one after the last accepted token. The alternative, re-running
the accepted tokens from a snapshot, costs a second pass over the recurrent state (the decode step's dominant
traffic) for every rejection; keeping states costs k extra copies of it per slot (k is 1 in Qwen3.5's setting)
and one gather.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from verl.workers.rollout.hf_engine.cache import SlotCache, SpecShape


class Qwen35SpecForwards:
    """Mixed into :class:`verl.models.qwen3_5.hf_runner.Qwen35Runner` (uses its submodule helpers)."""

    def spec_shape(self, k: int) -> SpecShape:
        """The cache layout for ``k`` draft tokens per step; an error when the model carries no usable head."""
        mtp = getattr(self._hf, "mtp", None)
        if mtp is None:
            raise ValueError("actor_rollout_ref.model.mtp.enable_rollout=true needs the checkpoint's MTP head "
                             "loaded on the rollout model (actor_rollout_ref.model.mtp.enable=true, and a checkpoint "
                             "with mtp_num_hidden_layers >= 1)")
        if mtp.num_layers != 1:
            raise ValueError(f"mtp.enable_rollout: speculative decoding drafts with a one-layer MTP head (Qwen3.5's); "
                             f"this checkpoint has mtp_num_hidden_layers={mtp.num_layers}")
        if k < 1:
            raise ValueError(f"actor_rollout_ref.model.mtp.num_speculative_tokens must be >= 1, got {k}")
        return SpecShape(k=k, n_draft_attn=1, hidden=self.cfg.hidden_size)

    @property
    def mtp(self):
        return self._hf.mtp

    # ------------------------------------------------------------------------------------------ shared parts
    def _attn_rows(self, m, x, cos, sin, kv, b, pos):
        """Attention of T new tokens per row (x: (b, T, H) at positions ``pos`` (b, T)) over the row's cache
        ``kv`` (2, slots, Hkv, L, D), writing their keys / values first; causal within the new tokens."""
        q, k, v, gate = self._attn_qkv(m, x, cos, sin)  # q: (b, T, Hq, D), k/v: (b, T, Hkv, D)
        t = x.shape[1]
        kc, vc = kv[0, :b], kv[1, :b]  # (b, Hkv, L, D)
        hkv, length, d = kc.shape[1], kc.shape[2], kc.shape[3]
        rows = torch.arange(b, device=x.device)
        heads = torch.arange(hkv, device=x.device)
        index = (rows[:, None, None], heads[None, None, :], pos[:, :, None])
        kc.index_put_(index, k.to(kc.dtype))
        vc.index_put_(index, v.to(vc.dtype))
        qg = q.reshape(b, t, hkv, -1, d).permute(0, 2, 3, 1, 4)  # (b, Hkv, G, T, D)
        scores = torch.matmul(qg, kc[:, :, None].transpose(-1, -2)).float() * m.scaling  # (b, Hkv, G, T, L)
        visible = torch.arange(length, device=x.device)[None, None, :] <= pos[:, :, None]  # (b, T, L)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vc.dtype)
        out = torch.matmul(probs, vc[:, :, None])  # (b, Hkv, G, T, D)
        out = out.permute(0, 3, 1, 2, 4).reshape(b, t, -1) * torch.sigmoid(gate)
        return m.o_proj(out)

    def _rope_rows(self, x, cache: SlotCache, b, pos):
        rope = (pos + cache.rope_delta[:b, None])[None].expand(3, -1, -1)
        return self.text.rotary_emb(x, rope)

    # ------------------------------------------------------------------------------------------ drafter
    def _mtp_rows(self, cache: SlotCache, b, tokens, hidden, pos):
        """The MTP layer over (b, T) positions ``pos``: inputs the embeddings of ``tokens`` (the token after each
        position) and ``hidden`` (b, T, H); returns its normed output (b, T, H)."""
        mtp = self.mtp
        layer = mtp.layers[0]
        emb = self.text.embed_tokens(tokens)
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self._rope_rows(x, cache, b, pos)
        x = x + self._attn_rows(layer.self_attn, layer.input_layernorm(x), cos, sin, cache.spec.kv[0], b, pos)
        x = x + self._mlp(layer, x)
        return mtp.norm(x)

    def mtp_prefill(self, cache: SlotCache, hidden, ids, rope, lens, targets) -> None:
        """After a packed prefill: the drafter's cache over each prompt's positions 0 .. L - 2 (whose next token
        is known), and the last position's target hidden state left for the first catch-up (count 1).
        ``hidden``: (T, H) normed final hidden states of the packed row, ``ids`` (T,), ``rope`` (3, 1, T)."""
        sp, dev = cache.spec, hidden.device
        starts = [sum(lens[:i]) for i in range(len(lens))]
        plan = [(s, i) for i, ts in enumerate(targets) for s in ts]
        slot_t = torch.tensor([s for s, _ in plan], device=dev)
        last = torch.tensor([starts[i] + lens[i] - 1 for _, i in plan], device=dev)
        sp.hid[slot_t, 0] = hidden.index_select(0, last).to(sp.hid.dtype)
        sp.count[slot_t] = 1
        # Positions t < L - 1 of each prompt (a prompt of one token has none).
        keep = [i for i in range(len(lens)) if lens[i] > 1]
        if not keep:
            return
        src = torch.cat([torch.arange(starts[i], starts[i] + lens[i] - 1, device=dev) for i in keep])
        n = [lens[i] - 1 for i in keep]
        cu = torch.tensor([0] + n, device=dev).cumsum(0).to(torch.int32)
        mtp = self.mtp
        layer = mtp.layers[0]
        emb = self.text.embed_tokens(ids.index_select(0, src + 1))
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden.index_select(0, src))],
                             dim=-1))[None]
        cos, sin = self.text.rotary_emb(x, rope.index_select(2, src))
        offset = {i: int(sum(n[:j])) for j, i in enumerate(keep)}
        kv_plan = [(s, i) for s, i in plan if lens[i] > 1]
        kv_slot = torch.cat([torch.full((lens[i] - 1,), s, device=dev) for s, i in kv_plan])
        kv_pos = torch.cat([torch.arange(lens[i] - 1, device=dev) for _, i in kv_plan])
        kv_src = torch.cat([torch.arange(lens[i] - 1, device=dev) + offset[i] for _, i in kv_plan])
        # The runner's packed attention prefill, writing into the drafter's cache instead of the main one; the
        # layer's output past its attention is not needed (only its cache matters here).
        self._attn_prefill(layer.self_attn, layer.input_layernorm(x), cos, sin, cu, max(n),
                           SimpleNamespace(kv=sp.kv), 0, kv_slot, kv_pos, kv_src)

    def draft_first(self, cache: SlotCache, b: int):
        """Catch up on the ``count`` newest positions and draft from the last: (logits (b, V), hidden (b, H))."""
        sp = cache.spec
        count = sp.count[:b]
        j = torch.arange(sp.k + 1, device=count.device)
        pos = (cache.lengths[:b] - count)[:, None] + j  # positions past count-1 are padding (see module doc)
        tokens = sp.ctok[:b].scatter(1, (count - 1)[:, None], cache.tokens[:b, None])
        out = self._mtp_rows(cache, b, tokens, sp.hid[:b], pos)
        last = out[torch.arange(b, device=out.device), count - 1]
        return self.lm_head(last), last

    def draft_next(self, cache: SlotCache, b: int, tokens, hidden, pos):
        """One more draft step per row at positions ``pos`` (b,): the drafter's own last output as its hidden."""
        out = self._mtp_rows(cache, b, tokens[:, None], hidden[:, None], pos[:, None])[:, 0]
        return self.lm_head(out), out

    # ------------------------------------------------------------------------------------------ verification
    def verify_logits(self, cache: SlotCache, b: int, tokens):
        """The main stack over ``tokens`` (b, T) at positions ``lengths ..``: (logits (b, T, V), normed hidden
        (b, T, H)). Attention caches get all T entries; the Gated DeltaNet states end after all T tokens and the
        intermediate ones are kept for :meth:`rewind`. Lengths are not advanced."""
        t = tokens.shape[1]
        pos = cache.lengths[:b, None] + torch.arange(t, device=tokens.device)
        h = self.text.embed_tokens(tokens)
        cos, sin = self._rope_rows(h, cache, b, pos)
        step = self.recurrent_step()
        h = self._layer_stack(
            h, lambda m, r, i: self._gdn_rows(m, r, cache, i, b, step),
            lambda m, r, i: self._attn_rows(m, r, cos, sin, cache.kv[i], b, pos))
        hn = self.text.norm(h)
        return self.lm_head(hn), hn

    def _gdn_rows(self, m, x, cache: SlotCache, li, b, step):
        sp = cache.spec
        _, t, _ = x.shape
        qkv = m.in_proj_qkv(x)  # (b, T, C)
        z = m.in_proj_z(x)
        beta, g = self._gates(m, x)
        w1 = cache.shape.conv_width - 1
        ext = sp.conv_ext[li, :b, : w1 + t]
        ext[:, :w1] = cache.conv[li, :b]
        ext[:, w1:] = qkv.to(ext.dtype)
        weight = m.conv1d.weight.squeeze(1)  # (C, W)
        mixed = (ext.unfold(1, w1 + 1, 1).to(weight.dtype) * weight[None, None]).sum(-1)  # (b, T, C)
        if m.conv1d.bias is not None:
            mixed = mixed + m.conv1d.bias
        mixed = F.silu(mixed).to(qkv.dtype)
        q, k, v = self._qkv_heads(m, mixed, b, t)
        state = cache.rec[li, :b]
        outs = []
        for j in range(t):
            sl = slice(j, j + 1)
            outs.append(step(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                             g[:, sl].contiguous(), beta[:, sl].contiguous(), state))
            if j < t - 1:
                sp.rec_hist[li, :b, j].copy_(state)
        core = torch.cat(outs, dim=1)
        dv = m.head_v_dim
        core = m.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, t, -1)
        return m.out_proj(core)

    def rewind(self, cache: SlotCache, b: int, fed) -> None:
        """Leave each row's Gated DeltaNet states as after the first ``fed`` (b,) (1 .. k + 1) tokens of the last
        verification: the conv window ends at its ``fed``-th input, the recurrent state is ``rec_hist`` (or the
        final state when all were kept)."""
        sp = cache.spec
        t = sp.k + 1
        w1 = cache.shape.conv_width - 1
        rows = torch.arange(b, device=fed.device)
        kept_all = (fed >= t)[:, None, None, None]
        pick = (fed - 1).clamp(min=0, max=t - 2)
        win = (fed[:, None] + torch.arange(w1, device=fed.device))[..., None]  # (b, W - 1, 1)
        for li in range(cache.shape.n_gdn):
            state = cache.rec[li, :b]
            state.copy_(torch.where(kept_all, state, sp.rec_hist[li, :b][rows, pick]))
            ext = sp.conv_ext[li, :b]
            cache.conv[li, :b].copy_(ext.gather(1, win.expand(-1, -1, ext.shape[-1])))
