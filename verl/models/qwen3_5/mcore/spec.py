"""Layer specs of the hybrid Qwen3.5 decoder for one pipeline chunk.

Each layer is megatron-core's TransformerLayer with Qwen3.5's zero-centred RMSNorms, a mixer chosen by
``config.linear_attention_freq`` (1: Gated DeltaNet, 0: gated full attention), and a dense MLP or a MoE layer
(router, grouped-GEMM experts with SequentialMLP's parameters, shared expert with its sigmoid gate). Linear layers come from megatron-core's
backend provider: the local (pure PyTorch tensor-parallel) classes by default, Transformer Engine's where
``transformer_impl="transformer_engine"`` is set and TE is installed (untested here: no TE build exists for
the machines this project is tested on).
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from verl.models.mcore.grouped_experts import GroupedGemmExperts
from verl.models.qwen3_5.mcore.attention import Qwen35GatedAttention
from verl.models.qwen3_5.mcore.common import ZeroCenteredRMSNorm
from verl.models.qwen3_5.mcore.gated_deltanet import Qwen35GatedDeltaNet


class GroupedExpertsLocalSpec(LocalSpecProvider):
    """megatron-core's local (pure PyTorch) provider, with grouped-GEMM experts in place of SequentialMLP's loop
    (same parameters: :mod:`verl.models.mcore.grouped_experts`)."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        spec = super().grouped_mlp_modules(moe_use_grouped_gemm)
        return partial(GroupedGemmExperts, *spec.args, **spec.keywords)


def backend_for(config):
    impl = getattr(config, "transformer_impl", "local")
    if impl == "local":
        return GroupedExpertsLocalSpec()
    if impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "actor_rollout_ref.actor.megatron.override_transformer_config.transformer_impl=transformer_engine "
                f"needs Transformer Engine ({exc}); leave it at 'local' to use the PyTorch spec"
            ) from exc
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    raise ValueError(f"transformer_impl={impl!r} is not supported by the Qwen3.5 spec (use 'local' or "
                     "'transformer_engine')")


def layer_spec(config, linear: bool, backend) -> ModuleSpec:
    linears = dict(linear_cls=backend.column_parallel_linear(), row_cls=backend.row_parallel_linear())
    mixer = ModuleSpec(module=Qwen35GatedDeltaNet if linear else Qwen35GatedAttention, params=linears)
    if config.num_moe_experts:
        mlp = get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=config.moe_grouped_gemm)
    else:
        mlp = partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
            linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ZeroCenteredRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def layers_of_chunk(config, vp_stage=None, pp_rank=None) -> range:
    """Global (0-based) layer indices of this rank's chunk (even split, megatron-core's interleaving)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage, pp_rank))


def decoder_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    pattern = config.linear_attention_freq
    if not isinstance(pattern, (list, tuple)) or len(pattern) != config.num_layers:
        raise ValueError("config.linear_attention_freq must list 1 (Gated DeltaNet) / 0 (attention) per layer")
    backend = backend_for(config)
    specs = [layer_spec(config, bool(pattern[i]), backend) for i in layers_of_chunk(config, vp_stage, pp_rank)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)
