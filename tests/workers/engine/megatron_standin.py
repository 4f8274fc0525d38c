"""A tiny megatron-core GPTModel (local spec) behind the model-registry functions the Megatron engine calls,
so the engine's own mechanics (parallel state, DDP, distributed optimizer, schedule, vocab-parallel
log-probs, offload, checkpoints) are tested independently of the Qwen3.5 model. GPU only."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from verl.protocol import DataProto

VOCAB = 512
HIDDEN = 128


def _hf_to_mcore_config(hf_config, dtype, **overrides):
    from megatron.core.transformer import TransformerConfig

    for key in ("attention_backend",):
        overrides.pop(key, None)  # the local spec has one attention implementation
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=256,
                             normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                             variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                             gradient_accumulation_fusion=False,
                             bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                             bias_dropout_fusion=False, apply_rope_fusion=False, **overrides)


def _init_model(tfconfig, hf_config, pre_process, post_process, share_embeddings_and_output_weights,
                value=False, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(tfconfig, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=1024,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                    position_embedding_type="rope", vp_stage=vp_stage)


def _forward(model, input_ids, position_ids, packed_seq_params=None, attention_mask=None, labels=None,
             temperature=1.0, calculate_entropy=False, chunk_size=None):
    """The registry forward contract: logits without ``labels``; with them {"log_probs", "entropy"?} (TP 1)."""
    if packed_seq_params is not None:
        raise ValueError("the stand-in's local attention takes padded batches only")
    valid = attention_mask.bool()
    length = input_ids.size(1)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=input_ids.device))
    allowed = causal[None] & valid[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=input_ids.device)[None]  # pad rows see self
    logits = model(input_ids, position_ids, (~allowed).unsqueeze(1))
    if labels is None:
        return logits
    logp = torch.log_softmax(logits.float() / temperature, -1)
    out = {"log_probs": logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if calculate_entropy:
        out["entropy"] = -(logp.exp() * logp).sum(-1)
    return out


def install():
    """Register the stand-in as ``verl.models.mcore.registry`` and skip HF weight loading; returns the
    function that puts the real registry and loader back (other GPU tests in the session need them)."""
    import sys

    import verl.models.mcore as pkg
    from verl.models.mcore import registry as real_registry
    from verl.workers.engine.megatron import weights

    real_loader = weights.load_initial_weights
    mod = types.ModuleType("verl.models.mcore.registry")
    mod.hf_to_mcore_config = _hf_to_mcore_config
    mod.init_mcore_model = _init_model
    mod.get_mcore_forward_fn = lambda hf_config: _forward
    mod.get_mcore_weight_converter = lambda hf_config: None
    sys.modules["verl.models.mcore.registry"] = mod
    pkg.registry = mod
    weights.load_initial_weights = lambda engine, chunks, path: [{} for _ in chunks]  # no checkpoint values

    def undo():
        sys.modules["verl.models.mcore.registry"] = real_registry
        pkg.registry = real_registry
        weights.load_initial_weights = real_loader

    return undo


def write_hf_config(path: str) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=256, tie_word_embeddings=False).save_pretrained(path)
    return path


# ------------------------------------------------------------------ shared by the engine GPU tests
def batch(seed=0, bsz=6, length=24, vocab=VOCAB, low=1, micro_batch_size=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (bsz, length), generator=g)
    mask = torch.ones(bsz, length, dtype=torch.long)
    for i in range(bsz):  # left padding of varying length, as prompts arrive
        mask[i, : i * 2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"micro_batch_size": micro_batch_size, "temperature": 1.0})


def nll_loss(outs, mb):
    mask = (mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1]).float()
    info = mb["global_batch_info"]
    loss = -(outs["log_probs"][:, :-1] * mask).sum() / info["batch_num_tokens"] * info["dp_size"]
    return loss, {"loss": loss.detach()}


def flat_params(eng):
    return torch.cat([p.detach().float().reshape(-1).cpu() for m in eng.model for p in m.parameters()])
