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


# Rows of one fp32 working buffer are chosen so that the buffer holds about this many elements (256 MiB in fp32):
# 270 rows of Qwen3.5's 248k vocabulary at tp=1, more rows at higher tp. The forward and backward keep at most
# two such buffers alive, instead of the four fp32 [chunk x V/tp] tensors autograd kept through plain torch ops.
# Read at call time, so tests can shrink it to cover several sub-chunks and a ragged tail.
SUB_CHUNK_ELEMENTS = 1 << 26


def _sub_rows(local_v: int) -> int:
    return max(1, SUB_CHUNK_ELEMENTS // max(local_v, 1))


class _VocabParallelLogProb(torch.autograd.Function):
    """log p(label) and entropy over a vocabulary sharded across ``tp_group``, with an analytic backward.

    Autograd through the elementwise ops would keep fp32 copies of the shifted logits, their exponentials and
    their product for the backward. Instead the forward keeps only the input logits (in their own dtype) and
    per-token scalars (the global log-partition and the entropy), and the backward rebuilds the softmax from
    them a sub-chunk of rows at a time, writing the gradient in place."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, calculate_entropy):
        ctx.set_materialize_grads(False)
        lead = logits.shape[:-1]
        local_v = logits.shape[-1]
        x = logits.reshape(-1, local_v)
        n = x.shape[0]
        tp = tp_group.size()
        start = tp_group.rank() * local_v if tp > 1 else 0
        local_labels = labels.reshape(-1) - start
        inside = (local_labels >= 0) & (local_labels < local_v)
        index = local_labels.clamp(0, local_v - 1).unsqueeze(-1)

        # The max over the input dtype is exact (casting to fp32 is monotone and lossless).
        m = x.amax(dim=-1).float()
        if tp > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        # rows of stats: sum exp(x - m), x[label] - m (0 off this shard), and sum exp(x - m) * (x - m)
        stats = torch.zeros(3 if calculate_entropy else 2, n, dtype=torch.float32, device=x.device)
        stats[1] = (x.gather(-1, index).squeeze(-1).float() - m) * inside
        rows = _sub_rows(local_v)
        shifted_buf = torch.empty(min(rows, n), local_v, dtype=torch.float32, device=x.device)
        exp_buf = torch.empty_like(shifted_buf) if calculate_entropy else None
        for i in range(0, n, rows):
            j = min(i + rows, n)
            shifted = shifted_buf[: j - i]
            shifted.copy_(x[i:j]).sub_(m[i:j].unsqueeze(-1))  # copy_: never write into an fp32 input
            if calculate_entropy:
                e = exp_buf[: j - i]
                torch.exp(shifted, out=e)
                stats[0, i:j] = e.sum(-1)
                stats[2, i:j] = e.mul_(shifted).sum(-1)
            else:
                stats[0, i:j] = shifted.exp_().sum(-1)
        del shifted_buf, exp_buf
        if tp > 1:  # one collective for all the partial sums; no autograd here, the backward is analytic
            torch.distributed.all_reduce(stats, group=tp_group)
        log_z = stats[0].log()
        log_probs = stats[1] - log_z
        entropy = log_z - stats[2] / stats[0] if calculate_entropy else None
        log_partition = m + log_z  # L: log sum_k exp(x_k) over the whole vocabulary

        ctx.start, ctx.calculate_entropy = start, calculate_entropy
        if calculate_entropy:
            ctx.save_for_backward(logits, labels, log_partition, entropy)
            return log_probs.view(lead), entropy.view(lead)
        ctx.save_for_backward(logits, labels, log_partition)
        return log_probs.view(lead), None

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        # Every rank of the tensor group computes the same log_probs/entropy, so the loss and its upstream
        # gradients are identical across ranks; the gradient below, built with the *global* log-partition, is
        # then the true gradient of that loss wrt this rank's shard, and no reduce is needed. (The input
        # gradient of the LM head's hidden states is summed over ranks by the column-parallel linear.)
        logits, labels, log_partition, *rest = ctx.saved_tensors
        if not ctx.calculate_entropy:
            grad_ent = None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None
        local_v = logits.shape[-1]
        x = logits.reshape(-1, local_v)
        n = x.shape[0]
        g_lp = grad_lp.reshape(-1).float() if grad_lp is not None else None
        g_ent = grad_ent.reshape(-1).float() if grad_ent is not None else None
        ent = rest[0] if ctx.calculate_entropy else None
        if g_lp is not None:
            local_labels = labels.reshape(-1) - ctx.start
            inside = (local_labels >= 0) & (local_labels < local_v)
            index = local_labels.clamp(0, local_v - 1).unsqueeze(-1)
            label_grad = (g_lp * inside).unsqueeze(-1)  # the [k == label] * grad_lp term, 0 off this shard

        grad = torch.empty_like(x)
        rows = _sub_rows(local_v)
        lp_buf = torch.empty(min(rows, n), local_v, dtype=torch.float32, device=x.device)
        p_buf = torch.empty_like(lp_buf) if g_ent is not None else None
        for i in range(0, n, rows):
            j = min(i + rows, n)
            lp = lp_buf[: j - i]
            lp.copy_(x[i:j]).sub_(log_partition[i:j].unsqueeze(-1))  # log p_k
            if g_ent is None:
                # d log p(label) / dx_k = [k == label] - p_k
                g = lp.exp_().mul_(-g_lp[i:j].unsqueeze(-1))
            else:
                # H = -sum_k p_k log p_k  =>  dH/dx_k = -p_k (log p_k + H); with the log-prob term,
                # grad_k = -p_k * (grad_lp + grad_ent * (log p_k + H)) + [k == label] * grad_lp
                p = p_buf[: j - i]
                torch.exp(lp, out=p)
                g = lp.add_(ent[i:j].unsqueeze(-1)).mul_(g_ent[i:j].unsqueeze(-1))
                if g_lp is not None:
                    g.add_(g_lp[i:j].unsqueeze(-1))
                g.mul_(p).neg_()
            if g_lp is not None:
                g.scatter_add_(-1, index[i:j], label_grad[i:j])
            grad[i:j].copy_(g)  # cast to the input dtype
        return grad.view(logits.shape), None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                             calculate_entropy: bool = False):
    """Local vocab shard ``logits`` [..., V/tp] (any float dtype; fp32 math) and global vocab ``labels`` [...]
    -> (log p(label), entropy or None), fp32, shaped ``logits.shape[:-1]``, reduced over ``tp_group`` (default:
    megatron's tensor-parallel group). See :class:`_VocabParallelLogProb` for the memory and gradient scheme."""
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group
    return _VocabParallelLogProb.apply(logits, labels, tp_group, calculate_entropy)


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
        # Float16Module hands the last stage's output back in fp32; the head runs in the weight's dtype. Under
        # checkpointing a chunk's backward holds its recomputed logits and their gradient (both in that dtype)
        # plus the log-prob Function's two fp32 sub-chunk buffers.
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
