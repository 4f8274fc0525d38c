"""FSDP2 helpers: wrap a HF model (one ``fully_shard`` unit per decoder layer), offload, full state dicts."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verl.utils.config import cfg_get

logger = logging.getLogger(__name__)


def create_device_mesh(world_size: int, fsdp_size: int, device_type: str) -> DeviceMesh:
    """1-D mesh over all ranks, or a (ddp, fsdp) hybrid mesh when ``fsdp_size`` divides the world."""
    if fsdp_size <= 0 or fsdp_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if world_size % fsdp_size != 0:
        raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: decoder layers of the LM and, for VL models, vision blocks.

    A MoE layer's experts live inside its decoder layer, so each layer's experts are gathered together.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        for m in model.modules():
            if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and all(hasattr(x, "forward") for x in m):
                layers = list(m)
                break
    return layers


def wrap_targets(model: torch.nn.Module, wrap_policy=None) -> list[torch.nn.Module]:
    """The sub-modules that get their own ``fully_shard`` unit (children before parents), from upstream's
    ``fsdp_config.wrap_policy``:

    * ``min_num_params > 0``: size-based, as FSDP1's size policy: walking bottom-up, a block (a module with
      children, not a container) whose parameters not yet in a unit reach ``min_num_params`` becomes a unit;
    * otherwise ``transformer_layer_cls_to_wrap`` (class names; default the model's ``_no_split_modules``,
      i.e. every decoder layer and vision block), or the first ModuleList of blocks for models without it.
    """
    min_params = int(cfg_get(wrap_policy, "min_num_params", 0) or 0)
    if min_params > 0:
        targets: list[torch.nn.Module] = []
        # A tied embedding / LM head is one parameter in two modules: it must stay in the root unit.
        tied = set()
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(model, "get_input_embeddings"):
            emb = model.get_input_embeddings()
            tied = {id(p) for p in emb.parameters()} if emb is not None else set()

        def visit(m: torch.nn.Module) -> tuple[int, bool]:
            own = list(m.parameters(recurse=False))
            results = [visit(c) for c in m.children()]
            remaining = sum(r[0] for r in results) + sum(p.numel() for p in own)
            holds_tied = any(r[1] for r in results) or any(id(p) in tied for p in own)
            # Blocks only: containers have no forward to hook, and a leaf layer's weight may be read directly
            # by its parent's forward (the patched Gated DeltaNet reads conv1d.weight), bypassing FSDP's hooks.
            block = bool(results) and not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
            if m is not model and block and not holds_tied and remaining >= min_params:
                targets.append(m)
                return 0, False
            return remaining, holds_tied

        visit(model)
        return targets
    names = cfg_get(wrap_policy, "transformer_layer_cls_to_wrap")
    if names is not None:
        names = {names} if isinstance(names, str) else set(names)
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if not layers:
            raise ValueError(f"fsdp_config.wrap_policy.transformer_layer_cls_to_wrap={sorted(names)} matches no "
                             f"module of {type(model).__name__}")
        return layers
    return decoder_layers(model)


def apply_fsdp2(model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: MixedPrecisionPolicy | None,
                param_offload: bool = False, reshard_after_forward: bool = True, wrap_policy=None) -> torch.nn.Module:
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision is not None:
        kw["mp_policy"] = mixed_precision
    if param_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    tie = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    targets = wrap_targets(model, wrap_policy)
    for layer in targets:
        fully_shard(layer, **kw)
    # Tied embeddings must stay in the root unit: sharding them separately would split one parameter.
    size_based = int(cfg_get(wrap_policy, "min_num_params", 0) or 0) > 0
    if not tie and not size_based:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None and not any(emb is t for t in targets):
            fully_shard(emb, **kw)
    fully_shard(model, **kw)
    return model


def full_state_dict(module: torch.nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter/buffer to a full CPU tensor (all ranks take part; others get {} if rank0_only)."""
    out = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, t in module.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if not rank0_only or rank == 0:
            out[name] = full.detach().cpu()
    return out


def fsdp_param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list on torch >= 2.12 (``_fsdp_param_groups``), one group or None
    before (``_fsdp_param_group``, torch 2.11 on the GPU image)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group")
    return [] if group is None else [group]


def _reshard_settings(m: FSDPModule):
    """What ``set_reshard_after_forward`` changes on one FSDP module (to put back afterwards): the configured
    ``reshard_after_forward`` (False keeps parameters gathered into backward) and the root's automatic choice.
    None where this torch keeps them elsewhere (the module then gets reshard_after_forward=True back)."""
    try:
        state = m._get_fsdp_state()
        return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp_param_groups(state)]
    except AttributeError:  # pragma: no cover - another torch layout
        return None


def _restore_reshard_settings(m: FSDPModule, saved) -> None:
    if saved is None:  # pragma: no cover
        m.set_reshard_after_forward(True, recurse=False)
        return
    state = m._get_fsdp_state()
    state._auto_reshard_after_forward = saved[0]
    for group, info in zip(fsdp_param_groups(state), saved[1]):
        group.post_forward_mesh_info = info


@contextlib.contextmanager
def gathered_for_inference(module: torch.nn.Module):
    """Keep parameters unsharded across many forwards (generation), resharding once at the end; each module's
    ``reshard_after_forward`` (``fsdp_config.reshard_after_forward``, the root's automatic choice) is the one
    it had before."""
    fsdp_mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    saved = [_reshard_settings(m) for m in fsdp_mods]
    for m in fsdp_mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, settings in zip(fsdp_mods, saved):
            m.reshard()
            _restore_reshard_settings(m, settings)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device) -> None:
    """Move every non-scalar optimizer state tensor (Adam moments; DTensor shards stay DTensors) to ``device``."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state[k] = v.to(device, non_blocking=True)


def move_grads(module: torch.nn.Module, device) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)
