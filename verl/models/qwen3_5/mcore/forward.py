"""Forward functions of the Qwen3.5 mcore model, and log-probs that never materialise the whole vocabulary.

:func:`qwen3_5_forward` is the registry's forward function:

* without ``labels``: the model's output — vocab-parallel logits [B, S, V/tp] on the last pipeline stage
  (hidden states on the others, values for a value model);
* with ``labels`` (already shifted: ``labels[t]`` is the token that follows position ``t``): a dict with
  ``log_probs`` [B, S] = log p(labels[t] | <= t) and, with ``calculate_entropy``, ``entropy`` [B, S]. The LM head
  runs on chunks of tokens under activation checkpointing and the softmax is reduced over tensor ranks, so at
  most ``chunk_size x V/tp`` logits exist at a time (Qwen3.5's vocabulary is 248k).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                             calculate_entropy: bool = False):
    """Local vocab shard ``logits`` [..., V/tp] (fp32 math) -> (log p(label), entropy or None), reduced over the
    tensor group with megatron's reduce (backward is the identity: each rank's loss is the same)."""
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group
    tp = tp_group.size()
    logits = logits.float()
    local_v = logits.shape[-1]
    start = tp_group.rank() * local_v if tp > 1 else 0
    with torch.no_grad():
        m = logits.max(dim=-1).values
        if tp > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    local_labels = labels - start
    inside = (local_labels >= 0) & (local_labels < local_v)
    picked = shifted.gather(-1, local_labels.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1) * inside
    # Every cross-rank dependency goes through one reduce whose result is identical on all ranks, so the
    # reduce's identity backward is exact (a local term using the *reduced* log-partition, as in
    # sum(softmax * logits) per shard, would miss the other shards' share of its gradient).
    weighted = (exp * shifted).sum(-1) if calculate_entropy else None
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, tp_group)
        picked = reduce_from_tensor_model_parallel_region(picked, tp_group)
        if weighted is not None:
            weighted = reduce_from_tensor_model_parallel_region(weighted, tp_group)
    log_z = sum_exp.log()
    log_probs = picked - log_z
    entropy = log_z - weighted / sum_exp if calculate_entropy else None
    return log_probs, entropy


def hidden_to_log_probs(model, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                        calculate_entropy: bool = False, chunk_size: int = 2048):
    """Final-normed hidden [S(/tp under SP), B, H] + labels [B, S] -> (log_probs [B, S], entropy [B, S] | None)."""
    config = model.config
    if config.sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    layer = model.output_layer
    weight = model.output_weight()
    weight = layer.weight if weight is None else weight
    s = hidden.shape[0]
    labels_sb = labels.transpose(0, 1)  # [S, B]

    def chunk_fn(h, lab):
        # Float16Module hands the last stage's output back in fp32; the head runs in the weight's dtype
        logits = torch.nn.functional.linear(h.to(weight.dtype), weight)
        if temperature != 1.0:
            logits = logits / temperature
        lp, ent = vocab_parallel_log_probs(logits, lab, calculate_entropy=calculate_entropy)
        return (lp, ent) if ent is not None else (lp,)

    lps, ents = [], []
    for i in range(0, s, chunk_size):
        h, lab = hidden[i : i + chunk_size], labels_sb[i : i + chunk_size]
        if torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(chunk_fn, h, lab, use_reentrant=False)
        else:
            out = chunk_fn(h, lab)
        lps.append(out[0])
        if calculate_entropy:
            ents.append(out[1])
    log_probs = torch.cat(lps, 0).transpose(0, 1)
    entropy = torch.cat(ents, 0).transpose(0, 1) if calculate_entropy else None
    return log_probs, entropy


def qwen3_5_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, packed_seq_params=None,
                    attention_mask=None, labels: Optional[torch.Tensor] = None, temperature: float = 1.0,
                    calculate_entropy: bool = False, chunk_size: int = 2048, **kwargs):
    """See the module docstring. ``model`` may be wrapped (DDP / Float16Module): it is called as is, and the
    log-prob path looks through ``.module`` for the output layer."""
    if labels is None:
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                     packed_seq_params=packed_seq_params)
    inner = model
    while not hasattr(inner, "output_weight") and hasattr(inner, "module"):
        inner = inner.module
    hidden = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                   packed_seq_params=packed_seq_params, return_hidden=True)
    if not inner.post_process:
        return hidden
    log_probs, entropy = hidden_to_log_probs(inner, hidden, labels, temperature, calculate_entropy, chunk_size)
    out = {"log_probs": log_probs}
    if entropy is not None:
        out["entropy"] = entropy
    return out
