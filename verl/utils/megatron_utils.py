"""Moving a megatron-core model's weights, gradients and optimizer state between GPU and CPU.

Colocated with a rollout engine, the trainer frees its GPU memory between phases. megatron-core's
DistributedDataParallel keeps every trainable parameter (dense, MoE expert and Gated DeltaNet alike,
grouped by dtype: the GDN layers' fp32 ``A_log`` / ``dt_bias`` land in a buffer of their own) as a view
into a flat ``param_data`` buffer, and its gradient (``param.main_grad``) as a view into ``grad_data``.
Offloading frees those buffers' storage in place (the tensor objects, and the optimizer's views of them,
survive); reloading re-grows the storage, copies the saved contents back and then re-points every
parameter's ``.data`` and ``.main_grad`` at its slot of the buffers, from the buffer's own index map. The
re-pointing is what keeps layers whose parameters were re-bound after DDP wrapped them (or any buffer
that was re-allocated) correct: without it their ``main_grad`` would point at freed memory and their
gradients would silently never reach the optimizer. Parameters that no buffer owns (frozen ones, and all of
a forward-only reference model's) move one by one, through pinned CPU copies kept for the next offload.

Functions take the list of model chunks (DDP-wrapped or not) or the megatron optimizer, like upstream's.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

__all__ = [
    "ddp_buffers",
    "load_megatron_model_to_gpu",
    "load_megatron_optimizer",
    "offload_megatron_model_to_cpu",
    "offload_megatron_optimizer",
    "unwrap_model",
]


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the wrapped model in ``.module``)."""
    while hasattr(chunk, "module") and isinstance(getattr(chunk, "module"), torch.nn.Module):
        chunk = chunk.module
    return chunk


def ddp_buffers(chunk: torch.nn.Module) -> list:
    """The ParamAndGradBuffers of a DDP-wrapped chunk (dense and expert-parallel); [] when not wrapped."""
    # An unwrapped module (the reference model) has only nn.Module.buffers, a method: not DDP's list.
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            found.extend(value)
    return found


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _offload_flat(holder, attr: str) -> None:
    """Copy ``holder.<attr>`` to pinned CPU memory and free its GPU storage in place."""
    tensor = getattr(holder, attr, None)
    if tensor is None or tensor.untyped_storage().size() == 0:
        return
    saved = getattr(holder, f"_verl_{attr}_cpu", None)
    if saved is None or saved.shape != tensor.shape or saved.dtype != tensor.dtype:
        saved = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        setattr(holder, f"_verl_{attr}_cpu", saved)
    saved.copy_(tensor, non_blocking=False)
    setattr(holder, f"_verl_{attr}_nbytes", tensor.untyped_storage().size())
    tensor.untyped_storage().resize_(0)


def _reload_flat(holder, attr: str) -> None:
    tensor = getattr(holder, attr, None)
    nbytes = getattr(holder, f"_verl_{attr}_nbytes", 0)
    if tensor is None or tensor.untyped_storage().size() > 0 or not nbytes:
        return
    tensor.untyped_storage().resize_(nbytes)
    tensor.copy_(getattr(holder, f"_verl_{attr}_cpu"), non_blocking=False)
    setattr(holder, f"_verl_{attr}_nbytes", 0)


def _repoint(buffer) -> None:
    """Make every parameter of ``buffer`` a view of its slot in ``param_data`` / ``grad_data`` again."""
    extra = set()
    for bucket in getattr(buffer, "buckets", []):
        extra.update(id(p) for p in getattr(bucket, "params_with_extra_main_grads", []))
    for param, (start, end, _bucket) in buffer.param_index_map.items():
        if buffer.param_data is not None and buffer.param_data.dtype == param.dtype:
            param.data = buffer.param_data[start:end].view(param.shape)
        if buffer.grad_data is not None and id(param) not in extra:
            param.main_grad = buffer.grad_data[start:end].view(param.shape)


def _buffer_param_ids(chunks: Iterable[torch.nn.Module]) -> set[int]:
    return {id(p) for chunk in chunks for buf in ddp_buffers(chunk) for p in buf.param_index_map}


def _loose_params(chunks) -> Iterator[torch.nn.Parameter]:
    owned = _buffer_param_ids(chunks)
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in owned:
                yield p


@torch.no_grad()
def offload_megatron_model_to_cpu(models, offload_params: bool = True, offload_grads: bool = True) -> None:
    """Free the GPU memory of the model chunks' parameters and/or gradients (contents kept on CPU)."""
    models = list(models)
    for chunk in models:
        for buf in ddp_buffers(chunk):
            if offload_params:
                _offload_flat(buf, "param_data")
            if offload_grads:
                # (fp32 "extra" main grads, kept only when gradients are reduced in a lower precision,
                # stay resident: they are separate tensors that no view points into.)
                _offload_flat(buf, "grad_data")
    if offload_params:
        _offload_loose([p for p in _loose_params(models) if p.device.type != "cpu"])
    torch.cuda.empty_cache()


def _offload_loose(params: list) -> None:
    """Move parameters that no DDP buffer owns (every parameter of the forward-only reference model) to the CPU,
    each into a pinned copy kept on the parameter and reused by every later offload. Pageable copies, newly
    allocated per offload and moved one blocking copy at a time, cost the reference role ~5 s per step at the
    35B-A3B and dense-twin shapes on 4 x H200 (2026-11-27), several times its forward pass."""
    pinned = torch.cuda.is_available()
    moved = []
    for p in params:
        host = getattr(p, "_verl_cpu", None)
        if host is None or host.shape != p.shape or host.dtype != p.dtype:
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pinned)
            p._verl_cpu = host
        host.copy_(p.data, non_blocking=pinned)
        moved.append((p, host))
    if pinned and moved:
        torch.cuda.synchronize()  # every copy landed before the device memory is let go
    for p, host in moved:
        p.data = host
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = p.main_grad.to("cpu")


@torch.no_grad()
def load_megatron_model_to_gpu(models, load_grad: bool = True, load_params: bool = True) -> None:
    """Undo :func:`offload_megatron_model_to_cpu` and re-point every ``.data`` / ``.main_grad`` view."""
    models = list(models)
    for chunk in models:
        for buf in ddp_buffers(chunk):
            if load_params:
                _reload_flat(buf, "param_data")
            if load_grad:
                _reload_flat(buf, "grad_data")
            if load_params and load_grad:
                _repoint(buf)
            elif load_params or load_grad:
                _repoint_partial(buf, params=load_params, grads=load_grad)
    if load_params:
        device = _device()
        for p in _loose_params(models):
            if p.device != device:
                # from the pinned copy (which stays on the parameter for the next offload): asynchronous
                p.data = p.data.to(device, non_blocking=p.data.is_pinned())
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = p.main_grad.to(device)
    torch.cuda.synchronize()


def _repoint_partial(buffer, params: bool, grads: bool) -> None:
    # Re-point only what is resident: a view of a freed storage must not be re-taken for the other half.
    if params and buffer.param_data is not None and buffer.param_data.untyped_storage().size() == 0:
        params = False
    if grads and buffer.grad_data is not None and buffer.grad_data.untyped_storage().size() == 0:
        grads = False
    for param, (start, end, _bucket) in buffer.param_index_map.items():
        if params and buffer.param_data is not None and buffer.param_data.dtype == param.dtype:
            param.data = buffer.param_data[start:end].view(param.shape)
        if grads and buffer.grad_data is not None:
            param.main_grad = buffer.grad_data[start:end].view(param.shape)


# ------------------------------------------------------------------------------------------- optimizer
def _sub_optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _state_tensors(opt) -> Iterator[tuple[dict, str]]:
    inner = getattr(opt, "optimizer", None)
    if inner is None:
        return
    for state in inner.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                yield state, key


def _main_params(opt) -> Iterator[torch.nn.Parameter]:
    inner = getattr(opt, "optimizer", None)
    if inner is None:
        return
    for group in inner.param_groups:
        yield from group["params"]


def _fp32_main_params(opt) -> Iterator[torch.nn.Parameter]:
    # With bf16 models the optimizer's params are fp32 master copies it owns (safe to move); with fp32
    # models they are the model's own parameters, which live in the DDP buffers and move with the model.
    for p in _main_params(opt):
        if getattr(opt, "config", None) is not None and (getattr(opt.config, "bf16", False) or
                                                         getattr(opt.config, "fp16", False)):
            yield p


@torch.no_grad()
def offload_megatron_optimizer(optimizer) -> None:
    """Optimizer state (Adam moments) and fp32 master weights to CPU."""
    for opt in _sub_optimizers(optimizer):
        for state, key in _state_tensors(opt):
            state[key] = state[key].to("cpu", non_blocking=False)
        for p in _fp32_main_params(opt):
            p.data = p.data.to("cpu", non_blocking=False)
            if p.grad is not None:
                p.grad = None  # rebuilt from the model's main_grad at the next step
    torch.cuda.empty_cache()


@torch.no_grad()
def load_megatron_optimizer(optimizer) -> None:
    device = _device()
    for opt in _sub_optimizers(optimizer):
        for state, key in _state_tensors(opt):
            state[key] = state[key].to(device, non_blocking=False)
        for p in _fp32_main_params(opt):
            p.data = p.data.to(device, non_blocking=False)
    torch.cuda.synchronize()
