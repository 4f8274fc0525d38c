"""Generic GPT loader and saver between a Hugging Face state dict and megatron-core model chunks (upstream's
``load_state_dict_to_megatron_gptmodel`` / ``merge_megatron_ckpt_gptmodel``, by name and arguments).

Model-independent: the name and layout rules come from the architecture's weight converter
(:func:`verl.models.mcore.registry.get_mcore_weight_converter`), and the parallel layout from megatron-core's
``parallel_state`` when it is initialised (one rank holding the whole model otherwise). The Megatron engine
loads and exports through the same converter (``verl.workers.engine.megatron.weights``); these functions are the
entry points :mod:`verl.models.weight_loader_registry` hands out.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from verl.models.mcore.registry import get_mcore_weight_converter
from verl.models.mcore.weight_loading import strip_wrapper_prefix

__all__ = ["load_state_dict_to_megatron_gptmodel", "merge_megatron_ckpt_gptmodel"]

_VALUE_HEAD = "output_layer."


def _parallel(conv) -> tuple[object, dict]:
    """(the converter's ParallelLayout, this rank's pp/tp/ep/etp ranks)."""
    try:
        from megatron.core import parallel_state as ps

        ready = ps.model_parallel_is_initialized()
    except ImportError:
        ready = False
    if not ready:
        return conv.ParallelLayout(), dict(pp=0, tp=0, ep=0, etp=0)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    layout = conv.ParallelLayout(tp=ps.get_tensor_model_parallel_world_size(),
                                 pp=ps.get_pipeline_model_parallel_world_size(),
                                 ep=ps.get_expert_model_parallel_world_size(),
                                 etp=ps.get_expert_tensor_parallel_world_size(), vpp=vpp)
    ranks = dict(pp=ps.get_pipeline_model_parallel_rank(), tp=ps.get_tensor_model_parallel_rank(),
                 ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank())
    return layout, ranks


def _chunks(wrapped_models) -> list:
    return list(wrapped_models) if isinstance(wrapped_models, (list, tuple)) else [wrapped_models]


@torch.no_grad()
def load_state_dict_to_megatron_gptmodel(state_dict: Mapping[str, torch.Tensor], wrapped_models, config,
                                         params_dtype: Optional[torch.dtype] = None, is_value_model: bool = False):
    """Copy this rank's shards of an HF ``state_dict`` into its model chunks (one per virtual pipeline stage).

    Every chunk parameter must be covered; with ``is_value_model`` the LM head is skipped (a critic's value
    head keeps its initialisation). Values are cast to each parameter's dtype, so ``params_dtype`` (upstream's
    argument) changes nothing here.
    """
    conv = get_mcore_weight_converter(config)
    layout, r = _parallel(conv)
    get = conv.hf_getter(state_dict)
    for vp_stage, chunk in enumerate(_chunks(wrapped_models)):
        state = conv.mcore_state_for_rank(get, config, layout, pp_rank=r["pp"], vp_stage=vp_stage, tp_rank=r["tp"],
                                          ep_rank=r["ep"], etp_rank=r["etp"])
        keep = ()
        if is_value_model:
            state = {k: v for k, v in state.items() if not k.startswith(_VALUE_HEAD)}
            keep = (_VALUE_HEAD,)
        conv.load_mcore_state(chunk, state, keep_init=keep)


def _local_shards(chunks: list, ranks: dict) -> dict:
    return {(ranks["pp"], vp_stage, ranks["tp"], ranks["ep"]):
            {strip_wrapper_prefix(n): p.detach().to("cpu") for n, p in chunk.named_parameters()}
            for vp_stage, chunk in enumerate(chunks)}


def _all_shards(local: dict) -> dict:
    """Every rank's chunk-local states (data-parallel replicas hold the same key and the same values)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


@torch.no_grad()
def merge_megatron_ckpt_gptmodel(wrapped_models, config, dtype: Optional[torch.dtype] = None,
                                 is_value_model: bool = False, tie_word_embeddings: bool = False) -> dict:
    """The full HF state dict of a model whose chunks are spread over the parallel layout (every rank returns it;
    all ranks must call). A value model (untied config: its chunks own an output layer) gets its head back as
    ``score.weight`` (HF's token-classification head); ``tie_word_embeddings`` drops ``lm_head.weight``.
    ``dtype`` casts the result."""
    conv = get_mcore_weight_converter(config)
    layout, r = _parallel(conv)
    shards = _all_shards(_local_shards(_chunks(wrapped_models), r))
    state = conv.mcore_shards_to_hf(shards, config, layout)
    if is_value_model:  # the output layer is the value head (1 x hidden), converted like the LM head
        state["score.weight"] = state.pop("lm_head.weight")
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.to(dtype) for k, v in state.items()} if dtype is not None else state
