"""The Qwen3.5 language model on megatron-core: embedding, hybrid decoder block, final norm, LM (or value) head.

A :class:`LanguageModule` (so megatron-core's tied-embedding handling across pipeline stages, DDP, the
distributed optimizer and the pipeline schedules apply unchanged) whose rotary angles come from the caller's
``position_ids`` (so packed sequences restart their positions exactly as the HF model sees them).
"""

from __future__ import annotations

from typing import Optional

import torch
from verl.models.mcore import require_megatron

require_megatron()  # a clear "install the mcore extra" error before the first megatron import

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_block import TransformerBlock

from verl.models.mcore.config_converter import tie_word_embeddings
from verl.models.qwen3_5.mcore.spec import decoder_block_spec
from verl.models.registry import get_text_config


class ValueHead(torch.nn.Linear):
    """hidden -> 1 scalar per token (critic). Replicated over tensor ranks; under sequence parallelism each rank
    sees other tokens, so its grad is summed over the tensor group like a layernorm's."""

    def __init__(self, config):
        super().__init__(config.hidden_size, 1, bias=False, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x, weight=None):
        return super().forward(x), None


class Qwen35Model(LanguageModule):
    # The engine shards packed rows over the context-parallel group only for models that say they take them
    # (their mixers read the CP group and the global boundaries: attention.py, gated_deltanet.py).
    supports_context_parallel = True

    def __init__(self, config, hf_config, pre_process: bool = True, post_process: bool = True,
                 share_embeddings_and_output_weights: bool = False, value: bool = False,
                 vp_stage: Optional[int] = None, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        text = get_text_config(hf_config)
        self.hf_config = hf_config
        self.vocab_size = int(text.vocab_size)
        self.max_sequence_length = int(text.max_position_embeddings)
        self.pre_process, self.post_process = pre_process, post_process
        self.value = value
        self.share_embeddings_and_output_weights = bool(share_embeddings_and_output_weights) and not value
        self.vp_stage = vp_stage
        self.vp_size = config.virtual_pipeline_model_parallel_size
        self.model_type = ModelType.encoder_or_decoder
        self.parallel_output = True
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=self.vocab_size, max_sequence_length=self.max_sequence_length,
                position_embedding_type="none", tp_group=self.pg_collection.tp,
            )
        rot_dim = int(config.kv_channels * config.rotary_percent)
        rot_dim -= rot_dim % 2
        # Not a buffer: Float16Module casts buffers to bf16, which would put whole radians of error into the
        # angles of late positions. Kept in fp32 and moved to the input's device on use.
        self._inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        self.decoder = TransformerBlock(
            config=config, spec=decoder_block_spec(config, vp_stage), pre_process=pre_process,
            post_process=post_process, pg_collection=self.pg_collection, vp_stage=vp_stage,
        )
        if post_process:
            if value:
                self.output_layer = ValueHead(config)
            else:
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size, self.vocab_size, config=config, init_method=config.init_method, bias=False,
                    skip_bias_add=False, gather_output=False,
                    skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights,
                    tp_group=self.pg_collection.tp,
                )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "one input tensor per pipeline stage"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, S, B, 1, rot]: cos and sin of the position angles (one tensor so activation recompute can save it)."""
        if position_ids.dim() == 3:  # mRoPE ids (3, B, S): text tokens carry one position in all three rows
            if not torch.equal(position_ids[0], position_ids[1]) or not torch.equal(position_ids[0], position_ids[2]):
                raise NotImplementedError("the Megatron Qwen3.5 model trains on text; image/video mRoPE positions "
                                          "are not supported")
            position_ids = position_ids[0]
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self._inv_freq  # [B, S, rot/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1).unsqueeze(2)  # [S, B, 1, rot]
        return torch.stack((emb.cos(), emb.sin())).to(dtype)

    def output_weight(self) -> Optional[torch.Tensor]:
        return self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                decoder_input=None, packed_seq_params=None, return_hidden: bool = False, **kwargs):
        """``input_ids`` / ``position_ids`` [B, S] ([1, T] packed with ``packed_seq_params``).

        Returns, on the last pipeline stage, vocab-parallel logits [B, S, V / tp] (value head: values [B, S]), or
        with ``return_hidden`` the final-normed hidden states [S, B, H] (sequence-sharded under sequence
        parallelism); on other stages the hidden states for the next stage.
        """
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)
        dtype = self.config.params_dtype if decoder_input is None else decoder_input.dtype
        if self.config.bf16:
            dtype = torch.bfloat16
        elif self.config.fp16:
            dtype = torch.float16
        rope = self.rotary(position_ids, dtype)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask, rotary_pos_emb=rope,
                              packed_seq_params=packed_seq_params)
        if not self.post_process or return_hidden:
            return hidden
        out, _ = self.output_layer(hidden, weight=self.output_weight())
        if self.value:
            if self.config.sequence_parallel:
                out = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
            return out.squeeze(-1).transpose(0, 1).contiguous()
        return out.transpose(0, 1).contiguous()


def build_qwen3_5_model(tfconfig, hf_config, pre_process: bool = True, post_process: bool = True,
                        share_embeddings_and_output_weights: Optional[bool] = None, value: bool = False,
                        vp_stage: Optional[int] = None, pg_collection=None) -> Qwen35Model:
    """The registry's model initializer for every Qwen3.5 architecture (VL checkpoints build the text model)."""
    if share_embeddings_and_output_weights is None:
        share_embeddings_and_output_weights = tie_word_embeddings(hf_config)
    return Qwen35Model(tfconfig, hf_config, pre_process=pre_process, post_process=post_process,
                       share_embeddings_and_output_weights=share_embeddings_and_output_weights, value=value,
                       vp_stage=vp_stage, pg_collection=pg_collection)
