"""Top-level forwards of a causal LM for the actor: logits, or fused per-token log-probs / entropy.

Shared by every architecture (``monkey_patch`` picks): ``forward_with_normal_backend`` (logits, and the MoE
load-balancing loss when router logits are asked for) for models whose layers are patched, and, with
``use_fused_kernels``, ``forward_with_torch_backend`` / ``forward_with_triton_backend`` (chunked over the
vocabulary: no full logits) for any causal LM with ``.model`` and ``.lm_head``. Cached decoding (``generate``)
and ``labels`` (HF's own loss) go to the stock forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers.modeling_outputs import CausalLMOutputWithPast

from verl.models.spec import get_text_config
from verl.models.transformers.patching import modeling_module
from verl.utils import ulysses as uly


def _wants_cache(kwargs) -> bool:
    return kwargs.get("past_key_values") is not None or bool(kwargs.get("use_cache"))


def _sp_group_if_active():
    group = uly.get_ulysses_sequence_parallel_group()
    if group is None or uly.get_ulysses_sequence_parallel_world_size(group) <= 1:
        return None
    return group


# ----------------------------------------------------------------------------------------------------------------
# Causal-LM heads: logits, or fused per-token log-probs / entropy
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class CausalLMOutputForPPO(CausalLMOutputWithPast):
    """What a patched top-level forward returns: logits (normal backend) or per-token log-probs and entropy
    (fused backends), plus the MoE load-balancing loss and router logits when they were asked for."""

    log_probs: Optional[torch.FloatTensor] = None
    entropy: Optional[torch.FloatTensor] = None
    aux_loss: Optional[torch.FloatTensor] = None  # MoE load-balancing loss, when router logits were asked for
    router_logits: Optional[tuple] = None


def _split_head_kwargs(kwargs):
    for key in ("return_dict", "output_attentions", "output_hidden_states", "num_items_in_batch"):
        kwargs.pop(key, None)
    return kwargs


def _stock_forward(self, input_ids, labels, kwargs):
    """The class's own forward (cached decoding in ``generate``; HF's loss when ``labels`` are given)."""
    return type(self).forward(self, input_ids=input_ids, labels=labels, **kwargs)


def _wants_router_logits(self, kwargs) -> bool:
    asked = kwargs.pop("output_router_logits", None)
    if asked is None:
        asked = getattr(get_text_config(self.config), "output_router_logits", False)
    return bool(asked)


def _backbone(self, input_ids, kwargs, routers: bool = False):
    """Final hidden states of the patched model, and with ``routers`` the MoE load-balancing loss (unscaled, as
    HF returns it) and the router logits it came from."""
    out = self.model(input_ids=input_ids, **({"output_router_logits": True} if routers else {}), **kwargs)
    router_logits = getattr(out, "router_logits", None) if routers else None
    if not router_logits:
        return out[0], None, None
    text = get_text_config(self.config)
    balance = modeling_module(self).load_balancing_loss_func
    # No attention mask: the patched layers route the real (packed) tokens only.
    aux_loss = balance(router_logits, text.num_experts, text.num_experts_per_tok, None)
    return out[0], aux_loss, router_logits


def forward_with_normal_backend(
    self, input_ids=None, labels=None, temperature: float = 1.0, shift_labels=None, **kwargs
):
    """Top-level forward of a patched causal LM without fused kernels: materialised logits (no temperature
    applied: the caller scales them), plus the MoE router's load-balancing loss when router logits are on.
    Cached decoding and ``labels`` (HF's loss) go to the stock forward."""
    if _wants_cache(kwargs) or labels is not None:
        return _stock_forward(self, input_ids, labels, kwargs)
    keep = kwargs.pop("logits_to_keep", 0)
    routers = _wants_router_logits(self, kwargs)
    hidden, aux_loss, router_logits = _backbone(self, input_ids, _split_head_kwargs(kwargs), routers)
    rows = slice(-keep, None) if isinstance(keep, int) else keep
    logits = self.lm_head(hidden[:, rows, :])
    return CausalLMOutputForPPO(logits=logits, aux_loss=aux_loss, router_logits=router_logits)


def _rolled_labels(input_ids, labels, shift_labels, local_len: int):
    """Next-token labels aligned with this rank's hidden states: labels[t] = ids[t + 1] (wrapping)."""
    if shift_labels is not None:
        return shift_labels
    source = labels if labels is not None else input_ids
    if source is None:
        raise ValueError("fused log-probs need input_ids, labels or shift_labels")
    sp = _sp_group_if_active()
    if sp is None:
        return torch.roll(source, shifts=-1, dims=-1)
    world, rank = dist.get_world_size(sp), dist.get_rank(sp)
    if source.shape[-1] == local_len:  # sliced ids: roll over the whole row, not within the shard
        source = uly.all_gather_tensor(source, dim=-1, group=sp)
    rolled = torch.roll(source, shifts=-1, dims=-1)
    return rolled[..., rank * local_len : (rank + 1) * local_len]


def _fused_forward(self, backend: str, input_ids=None, labels=None, temperature=1.0, shift_labels=None, **kwargs):
    from verl.utils.kernel.linear_logprob import linear_log_prob_entropy

    if _wants_cache(kwargs):  # generation samples from logits: the stock forward computes them
        return _stock_forward(self, input_ids, None, kwargs)
    kwargs.pop("logits_to_keep", None)
    if _wants_router_logits(self, kwargs):
        raise ValueError("the MoE router load-balancing loss (actor_rollout_ref.model.enable_router_aux_loss, or "
                         "output_router_logits in the model config) rides on the logits, which fused kernels never "
                         "materialise: set actor_rollout_ref.model.use_fused_kernels=false or turn the aux loss off")
    hidden = _backbone(self, input_ids, _split_head_kwargs(kwargs))[0]  # generic causal LMs come here too
    targets = _rolled_labels(input_ids, labels, shift_labels, hidden.shape[1])
    weight = self.lm_head.weight
    if hasattr(weight, "full_tensor"):  # DTensor under FSDP2 when called outside the module's hooks
        weight = weight.full_tensor()
    lead = hidden.shape[:-1]
    log_probs, entropy = linear_log_prob_entropy(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype),
        weight,
        targets.reshape(-1),
        temperature=temperature,
        backend=backend,
    )
    # FSDP2's root hook warns on every call about a view output (an in-place op on it would skip its backward
    # all-gather); one float per token is a cheap copy
    return CausalLMOutputForPPO(log_probs=log_probs.reshape(lead).clone(), entropy=entropy.reshape(lead).clone())


def forward_with_torch_backend(
    self, input_ids=None, labels=None, temperature: float = 1.0, shift_labels=None, **kwargs
):
    """Per-token log-prob of the next token and entropy, chunked over the vocabulary (no full logits)."""
    return _fused_forward(self, "torch", input_ids, labels, temperature, shift_labels, **kwargs)


def forward_with_triton_backend(
    self, input_ids=None, labels=None, temperature: float = 1.0, shift_labels=None, **kwargs
):
    """As :func:`forward_with_torch_backend`, with the Triton kernel."""
    return _fused_forward(self, "triton", input_ids, labels, temperature, shift_labels, **kwargs)
