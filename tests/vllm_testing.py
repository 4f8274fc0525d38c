"""Test helpers for the vLLM rollout tests (tiny checkpoints vLLM's CPU kernels accept, trainer scoring, and a
recording stand-in engine for server-mode protocol tests). Test code only: nothing in ``verl/`` imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

# vLLM's CPU Gated DeltaNet kernel rejects 32-wide key/value heads; 128 works (see docs/qwen3_5_vllm_fsdp.md).
CPU_ENGINE_SHAPES = dict(hidden_size=128, head_dim=32, linear_key_head_dim=128, linear_value_head_dim=128)
# CUDA: head dims FlashAttention serves (64) and the Triton Gated DeltaNet kernels take (64).
GPU_ENGINE_SHAPES = dict(hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)


def on_cuda() -> bool:
    return torch.cuda.is_available()


def engine_shapes() -> dict:
    return GPU_ENGINE_SHAPES if on_cuda() else CPU_ENGINE_SHAPES


def build_engine_checkpoint(path: str | Path, kind: str = "dense", seed: int = 0, **overrides):
    """Save a tiny Qwen3.5 (bf16, tokenizer alongside) and return the fp32 HF model of the same weights.
    ``overrides`` go to the text config (e.g. ``tie_word_embeddings=False``)."""
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    shapes = {**engine_shapes(), **overrides}
    model = build_tiny_qwen3_5(path, kind=kind, seed=seed, dtype=torch.bfloat16, **shapes)
    if kind.startswith("vl"):
        # The tiny builder's mRoPE sections sum to 2 (sized for head_dim 16), but vLLM has no head_dim-16
        # attention kernel and its mRoPE asserts sum == rotary_dim / 2 (4 at head_dim 32, 8 at 64). Text-only
        # positions are equal on the t/h/w axes, so re-splitting the sections changes no rotary angle.
        cfg_path = Path(path) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        half = shapes["head_dim"] // 8  # rotary_dim / 2 with Qwen3.5's partial_rotary_factor 0.25
        cfg["text_config"]["rope_parameters"]["mrope_section"] = [half // 2, half // 4, half // 4]
        cfg_path.write_text(json.dumps(cfg, indent=2))
    # On a GPU host the trainer side runs on the GPU too: with fla installed, transformers sends the Gated
    # DeltaNet to fla's Triton kernels, which cannot read CPU tensors.
    return model.float().to("cuda" if on_cuda() else "cpu")


def rollout_config(**overrides):
    from omegaconf import OmegaConf

    cfg = dict(
        name="vllm",
        mode="sync",
        prompt_length=32,
        response_length=16,
        max_num_seqs=4,
        dtype="bfloat16",
        enforce_eager=True,
        free_cache_engine=True,
        layered_summon=False,
        load_format="auto",
        tensor_model_parallel_size=1,
        checkpoint_engine=dict(update_weights_bucket_megabytes=1),
        engine_kwargs=dict(vllm={}),
    )
    if on_cuda():
        # Several engines start one after another in a test process: small ones, and no sleep mode unless a test
        # asks for it (vLLM's CuMem allocator serves one sleep-mode engine per process).
        cfg.update(gpu_memory_utilization=0.15, free_cache_engine=False, enable_sleep_mode=False)
    cfg.update(overrides)
    return OmegaConf.create(cfg)


def model_config(path, lora_rank: int = 0, **kw):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(path=str(path), lora_rank=lora_rank, lora_alpha=2 * lora_rank, **kw))


@torch.no_grad()
def trainer_logprobs(model, seq: list[int]) -> torch.Tensor:
    """Trainer-side log-prob of each token of ``seq`` given its prefix (first token excluded)."""
    dev = next(model.parameters()).device
    logits = model(torch.tensor([seq], device=dev)).logits.float()[0]
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(seq[1:], device=dev)[:, None])[:, 0].cpu()


def sgd_step(model, seq: list[int], lr: float, params: Optional[list] = None) -> None:
    """One optimizer step raising the likelihood of ``seq`` (plain, single process)."""
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    dev = next(model.parameters()).device
    logits = model(torch.tensor([seq], device=dev)).logits.float()[0]
    loss = -logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(seq[1:], device=dev)[:, None]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class RecordingEngine:
    """STAND-IN for :class:`verl.workers.rollout.vllm_rollout.vllm_rollout.vLLMRollout` inside a rollout server
    process, for protocol tests without vLLM (importable by the spawned server as
    ``tests.vllm_testing.RecordingEngine``). It records what arrives; it decides nothing.

    ``generate`` reports counters as token ids: [full updates, LoRA updates, tensors received, standalone,
    sleeps, wakes]; ``score`` returns the sums of the last update's tensors in arrival order, and the
    device type of each received tensor is kept in ``devices``.
    """

    def __init__(self, config, model_config, tokenizer=None, module=None, processor=None, standalone=False):
        self.full = self.lora = self.received = self.sleeps = self.wakes = 0
        self.standalone = standalone
        self.sums: list[float] = []
        self.names: list[str] = []
        self.devices: set[str] = set()

    def update_weights(self, weights, **kwargs):
        pairs = list(weights)
        self.received += len(pairs)
        self.sums = [float(t.float().sum()) for _, t in pairs]
        self.names = [n for n, _ in pairs]
        self.devices |= {t.device.type for _, t in pairs}
        if kwargs.get("lora"):
            self.lora += 1
            return
        if any(n == "fail.me" for n in self.names):
            raise RuntimeError("coverage check failed: fail.me")
        self.full += 1

    def generate(self, requests, params):
        from verl.workers.rollout.base import GenerationOutput

        counters = [self.full, self.lora, self.received, int(self.standalone), self.sleeps, self.wakes]
        return [[GenerationOutput(list(counters), None, "length")] for _ in requests]

    def score(self, sequences):
        return [list(self.sums) for _ in sequences]

    def sleep(self, tags=("weights", "kv_cache")):
        self.sleeps += 1

    def wake_up(self, tags=("weights", "kv_cache")):
        self.wakes += 1


def save_like(hf, src: str | Path, dst: str | Path) -> Path:
    """``hf``'s current weights as a bf16 checkpoint at ``dst`` with ``src``'s config.json (which may carry
    engine-specific tweaks, see :func:`build_engine_checkpoint`)."""
    import shutil

    dst = Path(dst)
    hf.save_pretrained(str(dst), state_dict={k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()})
    shutil.copy(Path(src) / "config.json", dst / "config.json")
    return dst


def fresh_engine_scores(hf, src: str | Path, dst: str | Path, seq: list[int], **rollout_overrides) -> torch.Tensor:
    """Log-probs of ``seq`` from a new engine started on ``hf``'s current weights (saved at ``dst``)."""
    import gc

    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    save_like(hf, src, dst)
    engine = vLLMRollout(rollout_config(load_format="auto", **rollout_overrides), model_config(dst), tokenizer=None)
    try:
        return torch.tensor(engine.score([seq])[0])
    finally:
        engine.shutdown()
        gc.collect()
