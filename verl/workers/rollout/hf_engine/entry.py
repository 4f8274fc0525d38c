"""The ``hf`` rollout's decode-engine path (models whose spec names a runner): engine requests -> decode-loop sequences -> engine outputs.

Settings come from the rollout config with their upstream meaning: ``max_num_seqs`` (slots), ``max_num_batched_tokens``
(prompt tokens per prefill forward), ``enforce_eager`` (no CUDA graphs), ``cudagraph_capture_sizes``,
``gpu_memory_utilization`` (caps the slots so that memory in use plus the slot cache stays under it);
``micro_batch_size`` (the hf engine's own key) also caps the slots. ``engine_kwargs.hf`` takes the knobs of
this engine alone (:data:`HF_ENGINE_KWARGS`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import defaultdict

import torch

from verl.utils.device import get_torch_device
from verl.utils.fsdp_utils import gathered_for_inference
from verl.workers.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.engine import DecodeEngine, EngineOptions, SeqRequest
from verl.workers.rollout.hf_engine.runner import PrefillSeq, runner_class
from verl.workers.rollout.hf_engine.sampling import SamplerConfig, sequence_key
from verl.workers.rollout.vision_tokens import expand_vision_tokens, vision_placeholder_ids

# engine_kwargs.hf.<key>: meaning
HF_ENGINE_KWARGS = {
    "state_dtype": "dtype of the Gated DeltaNet recurrent state in the slots: float32 (default) or bfloat16",
    "sync_every": "decode steps between two looks of the host at which sequences finished (default 4)",
    "continuous": "refill finished slots while others still run (default true); false = static batches",
    "recurrent_backend": "decode step of the Gated DeltaNet state: auto (this package's Triton kernel on CUDA, else "
                         "fla's), triton, fla, or torch (the reference)",
}


def engine_options(config) -> tuple[EngineOptions, str]:
    kw = dict((config.get("engine_kwargs") or {}).get("hf") or {})
    unknown = sorted(set(kw) - set(HF_ENGINE_KWARGS))
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.hf has unknown keys {unknown}; "
                         f"known: {sorted(HF_ENGINE_KWARGS)}")
    slots = int(config.get("max_num_seqs") or 256)
    if config.get("micro_batch_size"):
        slots = min(slots, int(config.micro_batch_size))
    sizes = config.get("cudagraph_capture_sizes")
    state_dtype = str(kw.get("state_dtype", "float32"))
    if state_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"engine_kwargs.hf.state_dtype must be float32 or bfloat16, got {state_dtype!r}")
    backend = str(kw.get("recurrent_backend", "auto"))
    if backend not in ("auto", "triton", "fla", "torch"):
        raise ValueError(f"engine_kwargs.hf.recurrent_backend must be auto, triton, fla or torch, got {backend!r}")
    opt = EngineOptions(
        max_num_seqs=slots,
        prefill_tokens=int(config.get("max_num_batched_tokens") or 8192),
        use_cuda_graph=not bool(config.get("enforce_eager", False)),
        capture_sizes=[int(s) for s in sizes] if sizes else None,
        sync_every=int(kw.get("sync_every", 4)),
        continuous=bool(kw.get("continuous", True)),
        state_dtype=getattr(torch, state_dtype),
        gpu_memory_utilization=float(config.get("gpu_memory_utilization") or 0) or None,
    )
    return opt, backend


def speculative_tokens(model_config) -> int:
    """Draft tokens per step from upstream's ``model.mtp`` section: ``num_speculative_tokens`` (vLLM's name for
    the MTP draft length) when ``mtp.enable`` and ``mtp.enable_rollout`` are set, else 0 (plain decoding)."""
    from verl.utils.config import cfg_get

    mtp = cfg_get(model_config, "mtp", None) if model_config is not None else None
    if not mtp or not cfg_get(mtp, "enable", False) or not cfg_get(mtp, "enable_rollout", False):
        return 0
    k = cfg_get(mtp, "num_speculative_tokens", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"actor_rollout_ref.model.mtp.num_speculative_tokens must be an integer >= 1, got {k!r}")
    return k


@contextlib.contextmanager
def unsharded(module: torch.nn.Module):
    """All parameters gathered for the whole rollout phase (the loop calls submodules directly, outside the
    FSDP2 forward hooks), resharded once at the end; a no-op for plain modules."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    with gathered_for_inference(module):
        if mods:
            if isinstance(module, FSDPModule):
                module._get_fsdp_state()._lazy_init()  # settle the root before any submodule runs
            for m in mods:
                m.unshard()
        yield


def _mm_inputs(request: GenerationRequest):
    outs = (request.multi_modal_data or {}).get("processor_outputs") or {}
    return {k: v for k, v in outs.items() if isinstance(v, torch.Tensor)} or None


def _mm_digest(mm) -> bytes:
    if not mm:
        return b""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(mm):
        h.update(k.encode())
        h.update(mm[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def build_sequences(requests: list[GenerationRequest], params: SamplingParams, model_config, seed: int):
    """One SeqRequest per (request, sample). The k-th sample of a given prompt (counting identical prompts
    across the call) gets the random stream ``(seed, prompt, k)``: independent of batching and order."""
    seen: dict = defaultdict(int)
    seqs, owner = [], []
    for r, req in enumerate(requests):
        ids = expand_vision_tokens(req, model_config)
        mm = _mm_inputs(req)
        digest = _mm_digest(mm)
        share = (tuple(ids), digest)
        for _ in range(params.n):
            occ = seen[share]
            seen[share] += 1
            seqs.append(SeqRequest(PrefillSeq(ids, mm), sequence_key(seed, ids, occ, digest), params.max_tokens,
                                   share))
            owner.append(r)
    return seqs, owner


def sampler_config(params: SamplingParams, model_config) -> SamplerConfig:
    return SamplerConfig(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         suppress_ids=tuple(vision_placeholder_ids(model_config)))


def draw_seed(params: SamplingParams) -> int:
    """The call's sampling seed: the caller's, else one draw from the global RNG (what a checkpoint restores)."""
    return params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,)).item())


@contextlib.contextmanager
def open_engine(rollout, params: SamplingParams):
    """A :class:`DecodeEngine` over the rollout's module, gathered and in eval mode for the block; afterwards the
    module is back in its mode and the cache goes back to the driver."""
    module = rollout.module
    opt, backend = engine_options(rollout.config)
    opt.record_routes = bool(rollout.config.get("enable_rollout_routing_replay", False))
    opt.num_speculative_tokens = speculative_tokens(getattr(rollout, "model_config", None))
    tape = engine = runner = None
    with unsharded(module):
        was_training = module.training
        module.eval()
        try:
            runner = runner_class(module.config)(module, backend)
            if opt.record_routes:
                from verl.models.transformers.router_replay import RouterTape

                tape = RouterTape(module)
                if not hasattr(runner, "record_routes") or tape.shape is None:
                    raise ValueError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true needs a MoE model "
                                     "(top-k routers) with a decode runner that records routes")
                runner.record_routes(tape)
            engine = DecodeEngine(runner, sampler_config(params, module.config), list(params.stop_token_ids), opt)
            yield engine
        finally:
            module.train(was_training)
            if tape is not None:
                tape.remove()
            engine = runner = tape = None  # the KV cache and CUDA-graph pools die with them
    # Hand the rollout's cache back to the driver, not just to torch's allocator: the phases that follow (the
    # actor update at 9B) need it, and Triton's kernel loads and autotuning allocate outside that allocator.
    get_torch_device().empty_cache()


def generate_with_engine(rollout, requests: list[GenerationRequest], params: SamplingParams):
    seqs, owner = build_sequences(requests, params, rollout.module.config, draw_seed(params))
    with open_engine(rollout, params) as engine:
        results = engine.run(seqs)
        rollout.last_stats = dict(engine.opt.stats)
    return engine_outputs(results, owner, len(requests), params)


def engine_outputs(results, owner: list[int], n_requests: int, params: SamplingParams):
    """Decode-loop results -> one list of outputs per request."""
    outputs: list[list[GenerationOutput]] = [[] for _ in range(n_requests)]
    for r, res in zip(owner, results):
        outputs[r].append(GenerationOutput(token_ids=res.tokens, log_probs=res.log_probs if params.logprobs else None,
                                           finish_reason=res.finish_reason, routed_experts=res.routes))
    return outputs
