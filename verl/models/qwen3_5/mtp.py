"""Qwen3.5 multi-token prediction (MTP): the checkpoint's ``mtp.*`` head, loaded next to the HF model and
trained with an extra next-next-token loss.

Layout and names (what Qwen3.5 / Qwen3-Next checkpoints ship and what vLLM's ``Qwen3_5MTP`` reads; transformers
drops these keys on load through ``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``). Per checkpoint:

    mtp.pre_fc_norm_hidden.weight      zero-centred RMSNorm of the main model's final (normed) hidden state
    mtp.pre_fc_norm_embedding.weight   zero-centred RMSNorm of the next token's embedding
    mtp.fc.weight                      [H, 2H], no bias: Linear over concat(normed embedding, normed hidden)
    mtp.layers.{i}.*                   one full-attention decoder layer per MTP depth, the main model's own
                                       decoder-layer names (input_layernorm, self_attn.{q,k,v,o}_proj,
                                       self_attn.{q,k}_norm, post_attention_layernorm, mlp.* / MoE experts)
    mtp.norm.weight                    final zero-centred RMSNorm before the shared LM head

The embedding table and the LM head are the main model's (shared, not duplicated under ``mtp.``). The
concatenation order (embedding first) is vLLM's, which is the engine that serves these weights.

Training (depth k = 0 .. n-1, ``h_0`` the main model's final hidden state at token t):
``h_{k+1} = norm(layer_k(fc([norm_e(embed(x_{t+k+1})), norm_h(h_k)])))`` predicts ``x_{t+k+2}`` through the
LM head. The attention reuses the main forward's rotary tables (positions of t): RoPE is relative, so the
constant offset vLLM/Megatron use (positions of t or t+1) does not change the attention scores.

Here the module is attached as ``model.mtp``, so the state dict (checkpoints, HF exports) carries the checkpoint's
own names. The loss is computed inside the model's forward (a hook on the text model's final norm), so FSDP2 has
every parameter gathered while the head runs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

MTP_PREFIX = "mtp."
__all__ = ["MTP_PREFIX", "Qwen3_5MTP", "num_mtp_layers", "read_mtp_state_dict", "attach_mtp", "MTPLossRunner", "Qwen35MTPSupport"]


def num_mtp_layers(hf_config) -> int:
    """``mtp_num_hidden_layers`` of the text config (0 when the checkpoint declares none)."""
    from verl.models.spec import get_text_config

    return int(getattr(get_text_config(hf_config), "mtp_num_hidden_layers", 0) or 0)


def _layer_classes(modeling):
    prefix = "Qwen3_5Moe" if "moe" in modeling.__name__ else "Qwen3_5"
    return getattr(modeling, prefix + "DecoderLayer"), getattr(modeling, prefix + "RMSNorm")


class Qwen3_5MTP(nn.Module):
    """The MTP head of one Qwen3.5 text config; parameter names are the checkpoint's, minus ``mtp.``."""

    def __init__(self, text_config, modeling, num_layers: Optional[int] = None):
        super().__init__()
        n = int(num_layers if num_layers is not None else getattr(text_config, "mtp_num_hidden_layers", 0) or 0)
        if n <= 0:
            raise ValueError("an MTP head needs mtp_num_hidden_layers >= 1 in the model config")
        decoder_cls, norm_cls = _layer_classes(modeling)
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        # Every MTP layer is a full-attention layer whatever the main stack's pattern is: a config copy whose
        # layer_types say so builds the main model's own decoder-layer class with the right token mixer.
        layer_cfg = copy.deepcopy(text_config)
        layer_cfg.layer_types = ["full_attention"] * n
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(decoder_cls(layer_cfg, i) for i in range(n))
        self.norm = norm_cls(h, eps=eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def step(self, k: int, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings, packed):
        """Depth ``k`` on one packed row: (1, T, H) hidden + embeddings of the following tokens -> (1, T, H)."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        # The decoder layer runs through this project's patched forward (packed, block-diagonal attention).
        x = self.layers[k](x, position_embeddings=position_embeddings, packed=packed)
        return self.norm(x)


# ------------------------------------------------------------------------------------------------ loading
def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def read_mtp_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor of the checkpoint at ``path``, names without the ``mtp.`` prefix."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(MTP_PREFIX):
                    out[key[len(MTP_PREFIX):]] = f.get_tensor(key)
    return out


_EXPERT_KEY = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE tensors (the checkpoint format: ``experts.{e}.{gate,up,down}_proj.weight``, which
    transformers also writes back on save) -> the fused parameters transformers 5 modules hold
    (``experts.gate_up_proj`` [E, 2I, H] = gate rows then up rows, ``experts.down_proj`` [E, H, I])."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
    for prefix, parts in groups.items():
        def stacked(kind):
            experts = parts.get(kind, {})
            if sorted(experts) != list(range(len(experts))) or not experts:
                raise ValueError(f"MTP checkpoint: {MTP_PREFIX}{prefix}.*.{kind}_proj.weight is incomplete "
                                 f"(experts {sorted(experts)})")
            return torch.stack([experts[e] for e in range(len(experts))])
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked("gate"), stacked("up")], dim=1)
        out[f"{prefix}.down_proj"] = stacked("down")
    return out


def _text_model(model: nn.Module) -> nn.Module:
    """The module holding ``embed_tokens`` / ``layers`` / ``norm`` / ``rotary_emb`` (text or VL checkpoints)."""
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


def attach_mtp(model: nn.Module, path: str | os.PathLike, key: str = "model.mtp.enable") -> Qwen3_5MTP:
    """Build the MTP head for ``model``, fill it from the checkpoint at ``path`` and attach it as ``model.mtp``.

    Missing or unexpected ``mtp.*`` tensors are an error naming them: a head left at its random init would train
    and export silently wrong weights."""
    from verl.models.transformers.patching import modeling_module

    n = num_mtp_layers(model.config)
    if n <= 0:
        raise ValueError(f"{key}=true but the checkpoint at {path} declares no MTP layers "
                         "(mtp_num_hidden_layers is 0 or absent from its config)")
    text = _text_model(model)
    ref = next(text.parameters())
    head = Qwen3_5MTP(text.config, modeling_module(text), n).to(dtype=ref.dtype, device=ref.device)
    state = fuse_expert_tensors(read_mtp_state_dict(path))
    expected = set(head.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: " + ", ".join(MTP_PREFIX + m for m in missing[:12])
                         + (" ..." if len(missing) > 12 else ""))
        if unexpected:
            parts.append("unexpected: " + ", ".join(MTP_PREFIX + u for u in unexpected[:12]))
        raise ValueError(f"{key}=true but the checkpoint at {path} does not hold the MTP weights its config "
                         f"declares (mtp_num_hidden_layers={n}); " + "; ".join(parts))
    head.load_state_dict(state, strict=True)
    model.add_module("mtp", head)
    return head


# ------------------------------------------------------------------------------------------------ training
@dataclass
class _Pending:
    ids: torch.Tensor  # (T,) token ids of the packed row
    targets: torch.Tensor  # (T,) bool: token j is a training target
    sums: list = field(default_factory=list)  # per depth: sum of CE over its targets (graph attached)
    counts: list = field(default_factory=list)  # per depth: number of targets


class MTPLossRunner:
    """Computes the MTP cross-entropy inside the model's forward.

    Hooks: a pre-hook on the first decoder layer records the packed row's rotary tables and boundaries (what the
    patched text forward hands every layer), and a hook on the text model's final norm runs the MTP depths on its
    output. :meth:`armed` says which token ids and target mask the next forward belongs to; outside it the hooks
    do nothing (the reference / log-prob passes and gradient-checkpoint recomputation)."""

    def __init__(self, model: nn.Module, detach_encoder: bool = False):
        self.model = model
        self.detach_encoder = detach_encoder
        self.text = _text_model(model)
        self._pending: Optional[_Pending] = None
        self._layer_kwargs: Optional[dict] = None
        self._handles = [
            self.text.layers[0].register_forward_pre_hook(self._record_layer_inputs, with_kwargs=True),
            self.text.norm.register_forward_hook(self._run_head),
        ]

    @property
    def head(self) -> Qwen3_5MTP:
        return self.model.mtp

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def armed(self, ids: torch.Tensor, targets: torch.Tensor):
        """``ids`` / ``targets``: (T,) over the packed row the text model will see (real tokens only)."""
        self._pending = _Pending(ids.reshape(-1), targets.reshape(-1).bool())
        self._layer_kwargs = None
        try:
            yield self._pending
        finally:
            self._pending = None
            self._layer_kwargs = None

    def _record_layer_inputs(self, module, args, kwargs):
        if self._pending is not None and self._layer_kwargs is None:
            self._layer_kwargs = dict(kwargs)

    def _run_head(self, module, args, output):
        pending = self._pending
        if pending is None or pending.sums:  # not armed, or already run (checkpoint recomputation)
            return None
        kw = self._layer_kwargs
        if kw is None or kw.get("packed") is None:
            raise RuntimeError("MTP training needs the patched Qwen3.5 forward (packed rows); the text model ran "
                               "its stock forward")
        hidden = output
        t = hidden.shape[1]
        if hidden.shape[0] != 1 or t != pending.ids.numel():
            raise RuntimeError(f"MTP: the packed row has {hidden.shape[1]} tokens but {pending.ids.numel()} ids "
                               "were armed (Ulysses sequence parallelism is not supported with MTP)")
        cu = kw["packed"].cu_seqlens.to(hidden.device).long()
        pos = torch.arange(t, device=hidden.device)
        seq_end = cu[1:][torch.bucketize(pos, cu[1:], right=True)]  # end (exclusive) of each token's sequence
        ids = pending.ids.to(hidden.device)
        targets = pending.targets.to(hidden.device)
        weight = self.model.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # a sharded DTensor outside its FSDP unit's forward
            weight = weight.full_tensor()
        # Upstream (Megatron MTP) keeps the LM head out of the MTP gradient: the head is trained by the main loss.
        weight = weight.detach()
        h = hidden.detach() if self.detach_encoder else hidden
        for k in range(self.head.num_layers):
            nxt = pos + k + 1
            nxt_ok = nxt < seq_end
            nxt_ids = torch.where(nxt_ok, ids[nxt.clamp(max=t - 1)], torch.zeros_like(ids))
            embeds = self.text.embed_tokens(nxt_ids.unsqueeze(0))
            if self.detach_encoder:
                embeds = embeds.detach()
            h = self.head.step(k, h, embeds, kw["position_embeddings"], kw["packed"])
            tgt = pos + k + 2
            ok = (tgt < seq_end) & targets[tgt.clamp(max=t - 1)]
            sel = ok.nonzero(as_tuple=False).squeeze(-1)
            labels = ids[tgt[sel]]
            # Logits of the target positions only: RL trains on responses, so most rows are prompt tokens.
            logits = F.linear(h[0].index_select(0, sel), weight).float()
            ce = F.cross_entropy(logits, labels, reduction="sum") if sel.numel() else h.sum() * 0.0
            pending.sums.append(ce)
            pending.counts.append(int(sel.numel()))
        return None


class Qwen35MTPSupport:
    """What :attr:`verl.models.spec.ModelSpec.mtp` names for Qwen3.5: the engine's entry points."""

    attach = staticmethod(attach_mtp)

    @staticmethod
    def runner(model: nn.Module, detach_encoder: bool = False) -> MTPLossRunner:
        return MTPLossRunner(model, detach_encoder=detach_encoder)
