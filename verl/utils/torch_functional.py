"""Tensor helpers used by actors, critics and trainers.

Log-prob / entropy helpers work on logits of shape ``(..., vocab)``; the vocab of
Qwen3.5 is large (~250k), so they process rows in chunks instead of
materialising a full ``log_softmax`` copy of the logits.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from verl.utils.device import get_device_id, get_device_name, get_torch_device
from verl.utils.py_functional import CheckError

# Rows x vocab elements upcast to float32 at once; ~256 MB of fp32 per chunk.
_LOGPROB_CHUNK_ELEMENTS = 64 * 1024 * 1024


class SequenceTooLongError(ValueError, NotImplementedError):
    """Raised by ``postprocess_data(truncation='error')``.

    Also a NotImplementedError, which is what upstream verl raised here.
    """


def gather_from_labels(data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``data[..., label]`` per position: (..., V) x (...) -> (...)."""
    return data.gather(-1, label.unsqueeze(-1)).squeeze(-1)


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise CheckError(
            f"labels must have the shape of logits without the vocab dim: logits {tuple(logits.shape)}, "
            f"labels {tuple(labels.shape)}. Shift/slice logits and labels to the same positions first."
        )


def _row_chunks(num_rows: int, vocab: int) -> int:
    return max(1, _LOGPROB_CHUNK_ELEMENTS // max(1, vocab))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """log p(label) under softmax(logits), shape ``logits.shape[:-1]``.

    Computed as ``logit[label] - logsumexp(logits)`` in float32, a block of rows
    at a time, so peak extra memory is one fp32 block rather than a full
    log-softmax copy. Output is float32 (float64 for float64 logits), which is
    also what fused GPU cross-entropy kernels return. ``inplace_backward`` is
    accepted for API compatibility; it only matters for fused kernels.
    """
    _check_logits_labels(logits, labels)
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).long()
    step = _row_chunks(flat_logits.shape[0], vocab)
    pieces = []
    for start in range(0, flat_logits.shape[0], step):
        block = flat_logits[start : start + step].to(out_dtype)
        picked = block.gather(-1, flat_labels[start : start + step].unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(block, dim=-1))
    if not pieces:  # zero rows
        return flat_logits.new_zeros(labels.shape, dtype=out_dtype)
    return torch.cat(pieces).view(labels.shape)


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference implementation: full ``log_softmax`` then gather (in the logits' dtype)."""
    _check_logits_labels(logits, labels)
    return gather_from_labels(F.log_softmax(logits, dim=-1), labels)


def logprobs_from_logits_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Alias of :func:`logprobs_from_logits` (the memory-light variant)."""
    return logprobs_from_logits(logits, labels)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Clamp ``x`` element-wise between tensor-valued bounds (broadcastable)."""
    return torch.minimum(torch.maximum(x, tensor_min), tensor_max)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: ``logsumexp(z) - sum(p * z)``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v ** 2`` over the last dim (upstream's name), in log space: squaring the
    probabilities directly underflows for a large vocabulary, ``logsumexp(2 * log_softmax)`` does not."""
    return torch.logsumexp(2.0 * torch.log_softmax(logits.float(), dim=-1), dim=-1).exp()


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Entropy for 2-D ``(N, V)`` logits, ``chunk_size`` rows at a time in float32."""
    if logits.dim() != 2:
        raise CheckError(f"entropy_from_logits_with_chunking expects (N, vocab) logits, got {tuple(logits.shape)}")
    if chunk_size <= 0:
        raise CheckError(f"chunk_size must be positive, got {chunk_size}")
    parts = [entropy_from_logits(logits[i : i + chunk_size].float()) for i in range(0, logits.shape[0], chunk_size)]
    if not parts:
        return logits.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Sum of ``values * mask``; NaN/inf outside the mask cannot leak into the result."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    total = kept * mask
    return total.sum() if axis is None else total.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Mean of the masked entries (``sum / (count + 1e-8)``, so an empty mask gives 0)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries; ``unbiased`` applies Bessel's correction n/(n-1)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise CheckError("At least one element in the mask has to be 1 to compute a variance.")
        if count == 1:
            raise CheckError(
                "The sum of the mask is one, which can cause a division by zero in the unbiased variance; "
                "use a larger (mini)batch or unbiased=False."
            )
        var = var * (count / (count - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise with masked mean/unbiased variance; ``shift_mean=False`` adds the mean back."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def get_response_mask(response_id: torch.Tensor, eos_token: int | list[int] = 2, dtype=torch.int64) -> torch.Tensor:
    """1 for tokens up to and including the first EOS in each row, 0 after it.

    ``eos_token`` may be one id or a list of ids (any of them ends the response).
    """
    eos = torch.as_tensor(eos_token, device=response_id.device).reshape(-1)
    is_eos = torch.isin(response_id, eos).to(torch.int64)
    eos_strictly_before = is_eos.cumsum(dim=-1) - is_eos
    return (eos_strictly_before == 0).to(dtype)


def compute_grad_norm(model: torch.nn.Module) -> float:
    """Sum of squared gradient entries over all parameters (the squared L2 norm)."""
    return float(sum(p.grad.detach().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


def broadcast_dict_tensor(tensors, src: int, group) -> None:
    """Broadcast every tensor of a dict/TensorDict from rank ``src`` (in place), in sorted-key order."""
    for key in sorted(tensors.keys()):
        torch.distributed.broadcast(tensors[key], src=src, group=group, async_op=False)


def allgather_dict_tensors(tensors, size: int, group, dim: int = 0):
    """All-gather each tensor of a dict/TensorDict and concatenate the shards along ``dim``."""
    from tensordict import TensorDict

    is_td = isinstance(tensors, TensorDict)
    source = tensors.to_dict() if is_td else tensors
    gathered = {}
    for key in sorted(source.keys()):
        shards = [torch.empty_like(source[key]) for _ in range(size)]
        torch.distributed.all_gather(shards, source[key], group=group, async_op=False)
        gathered[key] = torch.cat(shards, dim=dim)
    if is_td:
        return TensorDict(gathered, batch_size=tensors.batch_size[0] * size)
    return gathered


def allgather_dict_into_dict(data: dict, group=None) -> dict:
    """All-gather a picklable dict from every rank into ``{key: [value_rank0, value_rank1, ...]}``."""
    if not isinstance(data, dict):
        raise CheckError(f"Expect data to be a dictionary, got {type(data).__name__}")
    world = torch.distributed.get_world_size(group=group)
    per_rank: list = [None] * world
    torch.distributed.all_gather_object(per_rank, data, group=group)
    merged: dict = {}
    for rank_data in per_rank:
        for key, value in rank_data.items():
            merged.setdefault(key, []).append(value)
    return merged


def split_dict_tensor_into_batches(tensors, batch_size: int) -> list:
    """Split a TensorDict into equal batches of ``batch_size`` (must divide its length)."""
    if tensors.batch_size[0] % batch_size != 0:
        raise CheckError(
            f"input data batch size: {tensors.batch_size[0]}, split batch size: {batch_size}; "
            "the batch size must be a multiple of the split size"
        )
    return tensors.split(batch_size)


def pad_2d_list_to_length(response, pad_token_id, max_length=None) -> torch.Tensor:
    """Right-pad ragged rows to a 2-D tensor of width ``max(longest row, max_length)``."""
    longest = max(len(row) for row in response)
    width = max(longest, max_length) if max_length is not None else longest
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response])


def pad_sequence_to_length(tensors: torch.Tensor, max_seq_len: int, pad_token_id, left_pad: bool = False):
    """Pad the last dim up to ``max_seq_len`` (unchanged when already that long or longer)."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), value=pad_token_id)


def postprocess_data(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_length: int,
    pad_token_id: int,
    left_pad: bool = True,
    truncation: str = "error",
):
    """Pad or truncate ``(B, L)`` token ids and mask to exactly ``max_length`` columns.

    truncation: 'left' keeps the tail, 'right' keeps the head, 'middle' keeps
    both ends (head gets ``max_length // 2``), 'error' raises.
    """
    if truncation not in ("left", "right", "middle", "error"):
        raise CheckError(f"truncation must be one of left/right/middle/error, got {truncation!r}")
    if input_ids.ndim != 2:
        raise CheckError(f"input_ids must be 2-D (batch, seq), got shape {tuple(input_ids.shape)}")
    length = input_ids.shape[-1]
    if length < max_length:
        input_ids = pad_sequence_to_length(input_ids, max_length, pad_token_id, left_pad=left_pad)
        attention_mask = pad_sequence_to_length(attention_mask, max_length, 0, left_pad=left_pad)
    elif length > max_length:
        if truncation == "error":
            raise SequenceTooLongError(
                f"sequence_length={length} is larger than max_length={max_length}; raise max_length or "
                "pick truncation='left'|'right'|'middle'"
            )
        if truncation == "left":
            keep = lambda t: t[:, -max_length:]  # noqa: E731
        elif truncation == "right":
            keep = lambda t: t[:, :max_length]  # noqa: E731
        else:
            head = max_length // 2
            tail = max_length - head
            keep = lambda t: torch.cat([t[:, :head], t[:, length - tail :]], dim=-1)  # noqa: E731
        input_ids, attention_mask = keep(input_ids), keep(attention_mask)
    return input_ids, attention_mask


def tokenize_and_postprocess_data(
    prompt: str, tokenizer, max_length: int, pad_token_id: int, left_pad: bool = True, truncation: str = "error"
):
    """Tokenize ``prompt`` (no special tokens added) and run :func:`postprocess_data`."""
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    return postprocess_data(
        encoded["input_ids"], encoded["attention_mask"], max_length, pad_token_id, left_pad, truncation
    )


def remove_pad_token(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Token ids of each left-padded row without its padding, as Python lists."""
    rows = []
    for ids, mask in zip(input_ids, attention_mask, strict=True):
        rows.append(ids[ids.shape[0] - int(mask.sum()) :].tolist())
    return rows


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens: 0,1,2,... from the first 1; pads get 0."""
    return torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)


def log_probs_from_logits_response(input_ids: torch.Tensor, logits: torch.Tensor, response_length: int):
    """Log-probs of the last ``response_length`` tokens given full-sequence logits (shifted by one)."""
    return logprobs_from_logits(logits[:, -response_length - 1 : -1], input_ids[:, -response_length:])


def post_process_logits(input_ids, logits: torch.Tensor, temperature: float, top_k=None, top_p=None):
    """Divide logits by the temperature in place (top-k/top-p are not applied)."""
    if temperature != 1.0:
        logits = logits.div_(temperature)
    return logits


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_i p_i^2 of softmax(logits), computed in log space: exp(lse(2z) - 2 lse(z))."""
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def get_unpad_data(attention_mask: torch.Tensor):
    """(flat indices of kept tokens, cu_seqlens int32 starting at 0, max sequence length)."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per row ``(B,)`` over a 2-D jagged tensor ``(B, j)``."""
    if not nested_tensor.is_nested or nested_tensor.dim() != 2:
        raise CheckError("nested_tensor must be a 2-D jagged nested tensor (B, j)")
    if tensor.dim() != 1 or tensor.shape[0] != nested_tensor.shape[0]:
        raise CheckError(
            f"tensor must be 1-D with one value per row: got {tuple(tensor.shape)} for {nested_tensor.shape[0]} rows"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)


# ----------------------------------------------------------------------------- schedules


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    init_lr_ratio: Optional[float] = None,
    zero_indexed_step: bool = True,
) -> LambdaLR:
    """Linear warmup from ``init_lr_ratio`` (default 0) to 1, then cosine decay to ``min_lr_ratio``.

    The cosine part is ``min + (1 - min) * (1 + cos(2*pi*num_cycles*progress)) / 2``
    and never goes below ``min_lr_ratio``. ``zero_indexed_step=False`` counts steps from 1.
    """
    min_lr_ratio = 0.0 if min_lr_ratio is None else min_lr_ratio
    init_lr_ratio = 0.0 if init_lr_ratio is None else init_lr_ratio
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise CheckError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0.0 <= init_lr_ratio <= 1.0:
        raise CheckError(f"init_lr_ratio must be in [0, 1], got {init_lr_ratio}")

    def factor(step: int) -> float:
        step = step if zero_indexed_step else step + 1
        if step < num_warmup_steps:
            return init_lr_ratio + (1.0 - init_lr_ratio) * step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        wave = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
        return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * wave)

    return LambdaLR(optimizer, factor, last_epoch)


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warmup from 0 to the base lr over ``num_warmup_steps``, then constant."""

    def factor(step: int) -> float:
        return step / max(1.0, num_warmup_steps) if step < num_warmup_steps else 1.0

    return LambdaLR(optimizer, factor, last_epoch)


def get_wsd_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5, last_epoch: int = -1, stable_ratio: float = 0.9,
) -> LambdaLR:  # fmt: skip
    """Warmup-Stable-Decay: linear warmup, flat for ``stable_ratio`` of the rest, then cosine to ``min_lr_ratio``."""
    remaining = max(0, num_training_steps - num_warmup_steps)
    stable = int(remaining * stable_ratio)
    decay = remaining - stable

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        if step < num_warmup_steps + stable:
            return 1.0
        if step >= num_training_steps:
            return min_lr_ratio
        progress = (step - num_warmup_steps - stable) / max(1, decay)
        wave = max(0.0, 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * wave

    return LambdaLR(optimizer, factor, last_epoch)


# ----------------------------------------------------------------------------- distributed


@contextmanager
def check_device_is_available():
    """Fail fast when the accelerator is not initialised (some imports need it)."""
    if not get_torch_device().is_available():
        raise RuntimeError(f"Device {get_device_name()} must be initialized before importing this module.")
    yield


def distributed_mean_max_min_std(local_tensor, compute_max=True, compute_min=True, compute_std=True):
    """Global (mean, max, min, std) of a tensor spread over ranks; disabled stats are None."""
    total = local_tensor.sum()
    count = torch.tensor(local_tensor.numel(), device=local_tensor.device, dtype=total.dtype)
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(count)
    mean = total / count
    gmax = gmin = std = None
    if compute_max:
        gmax = local_tensor.max()
        torch.distributed.all_reduce(gmax, op=torch.distributed.ReduceOp.MAX)
    if compute_min:
        gmin = local_tensor.min()
        torch.distributed.all_reduce(gmin, op=torch.distributed.ReduceOp.MIN)
    if compute_std:
        squares = (local_tensor - mean).pow(2).sum()
        torch.distributed.all_reduce(squares)
        std = torch.sqrt(squares / (count - 1))
    return mean, gmax, gmin, std


def distributed_masked_mean(local_tensor: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """Mean of masked entries over all ranks."""
    total = (local_tensor * local_mask).sum()
    count = local_mask.sum().to(total.dtype)
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(count)
    return total / count


def all_gather_data_proto(data, process_group) -> None:
    """In-place all-gather of a DataProto across ``process_group`` (tensors via the device, rest via pickle)."""
    import numpy as np
    import torch.distributed as dist

    world = dist.get_world_size(group=process_group)
    home = data.batch.device
    device = get_device_name() if get_device_name() == "cpu" else get_device_id()
    data.to(device)
    data.batch = allgather_dict_tensors(data.batch.contiguous(), size=world, group=process_group, dim=0)
    data.to(home)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {k: np.concatenate([g[k] for g in gathered]) for k in data.non_tensor_batch}
