"""Shared by the mcore GPU test (and usable on CPU where megatron-core imports): build the Qwen3.5 mcore model
from an HF checkpoint through the weight converter and compare packed log-probs with HF per-sequence ones."""

from __future__ import annotations

import os

import torch


def init_single_process(device: str) -> None:
    """megatron-core with world size 1 (no launcher)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def build_mcore_from_hf(path: str, dtype: torch.dtype, device: str, **overrides):
    from transformers import AutoConfig

    from verl.models.mcore.registry import hf_to_mcore_config, init_mcore_model
    from verl.models.qwen3_5.mcore.weight_converter import load_mcore_state, mcore_state_for_rank, safetensors_getter

    hf_config = AutoConfig.from_pretrained(path)
    tfconfig = hf_to_mcore_config(hf_config, dtype, use_cpu_initialization=device == "cpu", **overrides)
    model = init_mcore_model(tfconfig, hf_config).to(device)
    load_mcore_state(model, mcore_state_for_rank(safetensors_getter(path), hf_config))
    model.eval()
    return model, hf_config


def packed_batch(lengths, vocab_low: int, vocab_high: int, device: str, seed: int = 0):
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(vocab_low, vocab_high, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None].to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return seqs, ids, pos, cu, params


def mcore_packed_log_probs(model, hf_config, ids, pos, cu, params, calculate_entropy=False):
    """Per-sequence next-token log-probs [(len - 1,), ...] from one packed forward."""
    from verl.models.mcore.registry import get_mcore_forward_fn

    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        out = get_mcore_forward_fn(hf_config)(model, ids, pos, packed_seq_params=params, labels=labels,
                                              calculate_entropy=calculate_entropy)
        logits = get_mcore_forward_fn(hf_config)(model, ids, pos, packed_seq_params=params)
    bounds = cu.tolist()
    lp = [out["log_probs"][0, s : e - 1] for s, e in zip(bounds[:-1], bounds[1:])]
    full = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[0, :, 0]
    lp_from_logits = [full[s : e - 1] for s, e in zip(bounds[:-1], bounds[1:])]
    return lp, lp_from_logits, out.get("entropy")


def hf_log_probs(path: str, seqs, dtype: torch.dtype, device: str):
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(path)
    cls = getattr(tf, config.architectures[0])
    model = cls.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = s[None].to(device)
            logits = model(input_ids=ids).logits.float()
            out.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def parity(path: str, dtype: torch.dtype, device: str, lengths=(37, 5, 64, 19), **overrides):
    """max |mcore - HF| over all next-token log-probs of a packed batch (fused path and full-logits path)."""
    from verl.models.registry import get_text_config

    model, hf_config = build_mcore_from_hf(path, dtype, device, **overrides)
    vocab = get_text_config(hf_config).vocab_size
    seqs, ids, pos, cu, params = packed_batch(list(lengths), 30, min(vocab, 120), device)
    lp, lp_logits, _ = mcore_packed_log_probs(model, hf_config, ids, pos, cu, params)
    ref = hf_log_probs(path, seqs, dtype, device)
    fused = max((a.float() - b.float()).abs().max().item() for a, b in zip(lp, ref))
    full = max((a.float() - b.float()).abs().max().item() for a, b in zip(lp_logits, ref))
    return fused, full


def realistic_decays(model):
    """Per-token log-decays g = -exp(A_log) * softplus(a + dt_bias) of a few tenths, as a trained Qwen3.5 has.

    The tiny random model draws A_log ~ log U(1, 16), so g is about -13 per token: every state is forgotten
    within a token and A_log barely matters. In fp64 on the CPU (dense, seed 3, layer 0) its gradient norm is
    1.4e-5 against 3.7-6.6 for the layer's projections, so any fp32 kernel's rounding is a large fraction of it:
    on 2 x H100 (2026-11-26) A_log's relative errors were 5.7e2 (layer 0), 1.4e2 and 1.7, the same on mcore's side
    and in transformers' own fla path. With these decays (state carried over a few tokens) its norm is 5.3e-2
    and it is held to the same bound as the rest. Whether fla's d(g) is exact at both decay scales is measured
    kernel against fp64 recurrence by scripts/gpu_gdn_grad_check.py."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.05, 0.5, generator=gen).log())
