"""Weights between Hugging Face checkpoints and the Megatron engine's sharded model chunks.

Loading: every rank reads only the HF tensors its own shards need (safetensors read tensor by tensor) and
builds its chunk-local state with the model's weight converter.

Export (rollout weight sync, HF checkpoints): every rank walks the same ordered list of parameters; a
parameter is gathered over its tensor (or expert-tensor) group, over the expert-parallel group for routed
experts (each expert rank owns different experts; consecutive expert tensors share one flat buffer and one
collective per group), and broadcast from the pipeline stage that holds it.
The converter turns each gathered mcore tensor into HF names and layouts. All ranks end up with every HF
tensor, in the same order, so a colocated rollout on each rank can load it.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Optional

import logging
import math

import torch
import torch.distributed as dist

from verl.models.mcore.lora import export_data, is_lora_param
from verl.utils.megatron_utils import unwrap_model

# ``engine`` arguments are the MegatronEngine (verl.workers.engine.megatron.engine), which calls in here; its
# name is only written in annotations so that this module does not import the engine back.

__all__ = ["build_hf_module", "iter_hf_weights", "layout_of", "load_dist_model", "load_initial_weights",
           "loses_precision", "seed_master_weights", "sync_hf_module"]

logger = logging.getLogger(__name__)


def layout_of(engine: "MegatronEngine"):
    s = engine.settings
    return engine.converter.ParallelLayout(tp=s.tp, pp=s.pp, ep=s.ep, etp=s.etp, vpp=(s.vpp or 1))


def _ranks():
    from megatron.core import parallel_state as ps

    return dict(pp=ps.get_pipeline_model_parallel_rank(), tp=ps.get_tensor_model_parallel_rank(),
                ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank())


@torch.no_grad()
def load_initial_weights(engine: "MegatronEngine", chunks: list, path: str) -> list[dict]:
    """Fill the freshly built chunks from the HF checkpoint (or from ``dist_checkpointing_path``).

    Returns, per chunk, the checkpoint values that the parameters' dtype rounded (an fp32 checkpoint loaded
    into bf16 parameters; empty for a bf16 checkpoint): :func:`seed_master_weights` starts the optimizer's
    fp32 master weights from them, as FSDP's fp32 parameters start from the checkpoint itself."""
    s = engine.settings
    if s.use_dist_checkpointing and s.dist_checkpointing_path:
        load_dist_model(chunks, s.dist_checkpointing_path)
        return [{} for _ in chunks]
    conv = engine.converter
    get = conv.safetensors_getter(path)  # reads one tensor at a time, only those this rank's shards need
    layout = layout_of(engine)
    r = _ranks()
    masters = []
    for vp_stage, chunk in enumerate(chunks):
        state = conv.mcore_state_for_rank(get, engine.hf_config, layout, pp_rank=r["pp"], vp_stage=vp_stage,
                                          tp_rank=r["tp"], ep_rank=r["ep"], etp_rank=r["etp"])
        if engine.role_spec.value_head:
            state.pop("output_layer.weight", None)  # the LM head; the critic's value head starts fresh
        params = {conv.strip_wrapper_prefix(n): p for n, p in unwrap_model(chunk).named_parameters()}
        extra = sorted(set(state) - set(params))
        missing = sorted(n for n in set(params) - set(state) if not _is_new_head(n, engine))
        if extra or missing:
            raise RuntimeError(f"HF -> megatron weight mapping does not match the model chunk {vp_stage}: "
                               f"not in the model {extra[:8]}, not in the mapping {missing[:8]}")
        precise = {}
        for name, tensor in state.items():
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: checkpoint shard {tuple(tensor.shape)} vs model {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            if loses_precision(tensor, param):
                precise[name] = tensor.detach().to("cpu", torch.float32).contiguous()
        masters.append(precise)
    return masters


def load_dist_model(chunks: list, path: str) -> None:
    """Initial weights from a megatron-core distributed checkpoint (``megatron.dist_checkpointing_path``)."""
    from megatron.core import dist_checkpointing

    sharded = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}
    loaded = dist_checkpointing.load(sharded, path)
    for i, m in enumerate(chunks):
        m.load_state_dict(loaded[f"model{i}"], strict=True)


def loses_precision(source: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether loading ``source`` into ``param`` lost precision that an fp32 master weight would keep."""
    if not source.is_floating_point() or torch.finfo(source.dtype).bits <= torch.finfo(param.dtype).bits:
        return False
    return not torch.equal(source.to(param.dtype).to(source.dtype), source)


@torch.no_grad()
def seed_master_weights(engine: "MegatronEngine", masters: list[dict]) -> int:
    """Start the optimizer's fp32 master weights from the checkpoint's own values where the model parameters
    rounded them (megatron-core otherwise copies the rounded bf16 parameters). Without this, an fp32
    checkpoint trains differently on Megatron than on FSDP: every master weight sits on the bf16 grid, so an
    update smaller than half a bf16 step leaves the forward's weights unchanged. Returns how many parameters
    were seeded."""
    if not any(masters):
        return 0
    strip = engine.converter.strip_wrapper_prefix
    # megatron-core matches these names against the wrapped chunks' parameter names without "module."
    states = [{strip(name): precise.get(strip(name), param) for name, param in chunk.named_parameters()}
              for chunk, precise in zip(engine.model, masters)]
    opt = engine.optimizer
    subs = getattr(opt, "chained_optimizers", [opt])
    if all(hasattr(o, "shard_fp32_from_float16_groups") for o in subs):  # distributed optimizer
        opt.reload_model_params(state_dict=states[0] if len(states) == 1 else
                                {f"model{i}": st for i, st in enumerate(states)})
    else:  # Float16OptimizerWithFloat16Params: parallel lists of model params and their fp32 masters
        source = {}
        for chunk, state in zip(engine.model, states):
            for name, param in chunk.named_parameters():
                source[param] = state[strip(name)]
        for o in subs:
            groups = zip(getattr(o, "float16_groups", []), getattr(o, "fp32_from_float16_groups", []))
            for model_group, main_group in groups:
                for model_param, main_param in zip(model_group, main_group):
                    main_param.copy_(source[model_param].reshape(main_param.shape))
    return sum(len(p) for p in masters)


def _is_new_head(name: str, engine: "MegatronEngine") -> bool:
    # The critic's value head has no counterpart in a causal-LM checkpoint; it keeps its initialisation.
    return engine.role_spec.value_head and name.startswith("output_layer.")


def _exported(engine: "MegatronEngine", local: str) -> bool:
    """Whether a parameter has a Hugging Face counterpart: not the critic's value head (no causal-LM twin), not a
    LoRA factor (merged into the weight it adapts on export, verl/models/mcore/lora.py)."""
    if engine.role_spec.value_head and local.startswith("output_layer."):
        return False
    return not is_lora_param(local)


def _param_entries(engine: "MegatronEngine") -> list[tuple]:
    """This rank's (local name, global name, param, is_expert, partition dim, gathered shape), chunk order."""
    conv = engine.converter
    layout = layout_of(engine)
    r = _ranks()
    s = engine.settings
    etp = s.etp if s.etp is not None else s.tp
    entries = []
    for vp_stage, chunk in enumerate(engine.model):
        for local, param in unwrap_model(chunk).named_parameters():
            local = conv.strip_wrapper_prefix(local)
            if not _exported(engine, local):
                continue
            glob = conv.global_mcore_name(local, engine.hf_config, layout, pp_rank=r["pp"], vp_stage=vp_stage,
                                          ep_rank=r["ep"])
            expert = conv.is_expert_param(glob)
            dim = conv.partition_dim(glob, engine.hf_config)
            size = etp if expert else s.tp
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= size
            entries.append((local, glob, param, expert, dim, tuple(shape)))
    return entries


def _gather_over(tensor: torch.Tensor, group, dim: Optional[int]) -> list[torch.Tensor]:
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


# Routed experts move over the expert-TP and expert-parallel groups (and between pipeline stages) in runs of
# consecutive tensors of one dtype, up to this many bytes gathered over expert-TP, not one collective per tensor:
# per tensor, a sync of Qwen3.5-35B-A3B at 16 layers and EP 4 issued 2,048 all-gathers and took 3.5 s
# (4 x H200, 2026-11-27). A run costs this much again per expert rank while its tensors are handed out.
EXPERT_RUN_BYTES = 128 << 20


class _Meta(NamedTuple):
    """One exported parameter as every pipeline stage learns it (picklable: sent with all_gather_object)."""

    local: str  # chunk-local name
    glob: str  # global mcore name (this rank's experts numbered globally)
    expert: bool  # a routed expert's (gathered over expert-TP and EP)
    dim: Optional[int]  # partition dim over TP / expert-TP; None when replicated
    shape: tuple  # gathered over TP / expert-TP
    dtype: str  # torch dtype name
    vp: int  # virtual pipeline stage


def _runs(meta: list[_Meta], cap: int) -> list[list[_Meta]]:
    """``meta`` in what moves together: every other parameter alone; consecutive routed-expert entries of one
    dtype up to ``cap`` bytes of gathered size."""
    runs: list[list[_Meta]] = []
    size = 0
    for e in meta:
        nbytes = math.prod(e.shape) * getattr(torch, e.dtype).itemsize
        last = runs[-1] if runs else None
        if e.expert and last is not None and last[0].expert and last[0].dtype == e.dtype and size + nbytes <= cap:
            last.append(e)
            size += nbytes
        else:
            runs.append([e])
            size = nbytes
    return runs


@torch.no_grad()
def _gathered_mcore_tensors(engine: "MegatronEngine") -> Iterator[tuple[str, torch.Tensor]]:
    """(global mcore name, tensor gathered over TP/ETP, EP and PP) on every rank, same order everywhere."""
    from megatron.core import parallel_state as ps

    conv = engine.converter
    s = engine.settings
    layout = layout_of(engine)
    pp_group = ps.get_pipeline_model_parallel_group() if s.pp > 1 else None
    entries = _param_entries(engine)
    # Every pipeline stage learns what the others hold (names, shapes, dtypes), in stage order.
    mine = [_Meta(local, glob, expert, dim, shape, str(p.dtype).split(".")[-1], vp)
            for vp, (local, glob, p, expert, dim, shape) in _with_vp(engine, entries)]
    if pp_group is not None:
        all_meta = [None] * s.pp
        dist.all_gather_object(all_meta, mine, group=pp_group)
    else:
        all_meta = [mine]
    my_pp = ps.get_pipeline_model_parallel_rank()
    params = {(vp, e[0]): e[2] for vp, e in _with_vp(engine, entries)}  # (vp, local name) -> this rank's param
    device = entries[0][2].device if entries else torch.device("cuda", torch.cuda.current_device())
    tp_group = ps.get_tensor_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if s.ep > 1 else None

    def gathered(local: str, vp: int, dim: Optional[int]) -> torch.Tensor:  # a dense parameter, over TP
        parts = _gather_over(export_data(params[(vp, local)]), tp_group, dim)
        return parts[0] if dim is None else torch.cat(parts, dim=dim)

    for stage, meta in enumerate(all_meta):
        src = dist.get_global_rank(pp_group, stage) if pp_group is not None else None
        for run in _runs(meta, EXPERT_RUN_BYTES):
            first = run[0]
            if not first.expert:
                full = gathered(first.local, first.vp, first.dim) if stage == my_pp else torch.empty(
                    first.shape, dtype=getattr(torch, first.dtype), device=device)
                if src is not None:
                    dist.broadcast(full, src=src, group=pp_group)
                yield first.glob, full
                continue
            # A run of routed experts, flattened into one buffer: one gather over expert-TP (shards side by side
            # per rank, each tensor then joined along its partition dim), one over EP (the same local slot on
            # every expert rank is a different global expert), one broadcast per expert rank between stages.
            sizes = [math.prod(e.shape) for e in run]
            if stage == my_pp:
                flat = torch.cat([t.reshape(-1) for t in _joined_over_etp(run, params, etp_group)])
                per_ep = _gather_over(flat, ep_group, None)
            else:
                per_ep = [torch.empty(sum(sizes), dtype=getattr(torch, first.dtype), device=device)
                          for _ in range(s.ep if ep_group is not None else 1)]
            if src is not None:
                for t in per_ep:
                    dist.broadcast(t, src=src, group=pp_group)
            offset = 0
            for e, n in zip(run, sizes):
                for ep_rank, t in enumerate(per_ep):
                    name = e.glob if ep_group is None else conv.global_mcore_name(
                        e.local, engine.hf_config, layout, pp_rank=stage, vp_stage=e.vp, ep_rank=ep_rank)
                    yield name, t[offset: offset + n].view(e.shape)
                offset += n


def _joined_over_etp(run: list[_Meta], params: dict, etp_group) -> list[torch.Tensor]:
    """This rank's expert tensors of ``run`` gathered over expert-TP with one collective: the local shards
    flattened into one buffer, gathered, and each tensor's shards joined along its partition dim."""
    shards = [export_data(params[(e.vp, e.local)]) for e in run]
    if (dist.get_world_size(etp_group) if etp_group is not None else 1) == 1:
        return shards
    per_rank = _gather_over(torch.cat([t.reshape(-1) for t in shards]), etp_group, None)
    joined, offset = [], 0
    for e, t in zip(run, shards):
        parts = [p[offset: offset + t.numel()].view(t.shape) for p in per_rank]
        joined.append(parts[0] if e.dim is None else torch.cat(parts, dim=e.dim))
        offset += t.numel()
    return joined


def _with_vp(engine, entries):
    """Pair each entry with its virtual stage (entries are built chunk by chunk)."""
    def kept(name: str) -> bool:
        return _exported(engine, engine.converter.strip_wrapper_prefix(name))

    counts = [sum(1 for n, _ in unwrap_model(c).named_parameters() if kept(n)) for c in engine.model]
    i = 0
    for vp, n in enumerate(counts):
        for e in entries[i: i + n]:
            yield vp, e
        i += n


def iter_hf_weights(engine: "MegatronEngine", bucket_megabytes: float = 512,
                    dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs, routed experts in HF's fused module layout (what the FSDP path and
    the rollout engines' loaders take). Collective: every rank must exhaust it.

    Tensors are gathered one at a time, routed experts in runs of up to ``EXPERT_RUN_BYTES`` per expert rank,
    so at most one such run (or one full tensor) is held beyond what the consumer keeps; ``bucket_megabytes``
    is the consumer's grouping (the rollout's loader buckets what it receives) and does not change what is
    gathered here."""
    s = engine.settings
    etp = s.etp if s.etp is not None else s.tp
    stream = engine.converter.to_hf_stream(_gathered_mcore_tensors(engine), engine.hf_config, tp_size=s.tp,
                                           etp_size=etp, expert_format="fused")
    for name, tensor in stream:
        yield name, (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)


def build_hf_module(engine: "MegatronEngine") -> torch.nn.Module:
    """A Hugging Face copy of the policy on this GPU, for the ``hf`` rollout (which generates with an HF
    module), patched like the FSDP path's model; :func:`sync_hf_module` refreshes it from the Megatron shards
    after every update. It costs one more copy of the weights per GPU. Built on the GPU without reading the
    checkpoint: the sync that follows writes every parameter (and proves it), so a load from disk would only
    pass the whole checkpoint through host memory on every rank at once."""
    from verl.models.registry import build_hf_model_without_weights
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    dtype = torch.bfloat16 if engine.settings.dtype == "bfloat16" else torch.float32
    module = build_hf_model_without_weights(
        engine.model_path, torch.device("cuda", torch.cuda.current_device()), dtype=dtype, for_vl=False,
        trust_remote_code=bool(engine.model_config.get("trust_remote_code", False)))
    apply_monkey_patch(module)
    return module.eval()


def release_hf_module(module: torch.nn.Module) -> bool:
    """Free the storage of every parameter of ``module`` in place (the tensors keep their shapes; reading them
    before :func:`restore_hf_module` fails). Returns False when they were already released."""
    if getattr(module, "_verl_released", None):
        return False
    sizes = {}
    for p in module.parameters():  # tied parameters share one storage: free (and later restore) it once
        storage = p.data.untyped_storage()
        sizes.setdefault(storage.data_ptr(), (p.data, storage.size()))
    for tensor, _ in sizes.values():
        tensor.untyped_storage().resize_(0)
    module._verl_released = list(sizes.values())
    return True


def restore_hf_module(module: torch.nn.Module) -> None:
    """Give a released module's parameters uninitialised storage of their old size again (a sync fills it)."""
    for tensor, nbytes in getattr(module, "_verl_released", None) or ():
        tensor.untyped_storage().resize_(nbytes)
    module._verl_released = None


@torch.no_grad()
def sync_hf_module(engine: "MegatronEngine", module: torch.nn.Module) -> None:
    """Copy the current weights into ``module`` (collective) and prove every parameter was written once."""
    from verl.workers.weight_sync import check_coverage

    params = dict(module.named_parameters())
    written = []
    for name, tensor in engine.get_per_tensor_param():
        written.append(name)
        if name in params:
            params[name].copy_(tensor.to(params[name].dtype))
    check_coverage(params.keys(), written)


def apply_engine_lora(engine: "MegatronEngine", chunks: list) -> list[dict]:
    """Adapters on the selected linears, everything else frozen (before DDP, which buckets trainable parameters
    only). The frozen base needs no fp32 master weights: returns empty ones (see :func:`seed_master_weights`)."""
    from verl.models.mcore.lora import apply_lora

    layout, r = layout_of(engine), _ranks()

    def global_name(vp_stage: int, local: str) -> str:
        return engine.converter.global_mcore_name(local, engine.hf_config, layout, pp_rank=r["pp"],
                                                  vp_stage=vp_stage, ep_rank=r["ep"])

    s = engine.settings
    adapted = apply_lora(chunks, engine.lora, global_name, expert_tp=s.etp if s.etp is not None else s.tp)
    trainable = sum(p.numel() for m in chunks for p in m.parameters() if p.requires_grad)
    total = sum(p.numel() for m in chunks for p in m.parameters())
    logger.warning("%s: LoRA rank %d (alpha %s) on %d linears (%s); %d of %d parameters of this rank train",
                   engine._prefix, engine.lora.rank, engine.lora.alpha, len(adapted),
                   ", ".join(sorted({n.rsplit(".", 1)[-1] for n in adapted})), trainable, total)
    return [{} for _ in chunks]
