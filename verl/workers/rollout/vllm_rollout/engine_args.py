"""``actor_rollout_ref.rollout`` config -> ``vllm.LLM`` arguments, and our SamplingParams <-> vLLM's.

Pure Python (no vLLM import): the rules are unit-tested on CPU; :mod:`.vllm_rollout` applies them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from verl.workers.rollout.base import GenerationOutput, SamplingParams
from verl.utils.config import cfg_get as _get

# Keys of the rollout config that are this module's business (upstream names).
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}


def _plain(obj) -> dict:
    if obj is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(obj, DictConfig):
            return dict(OmegaConf.to_container(obj, resolve=True))
    except ImportError:  # pragma: no cover
        pass
    return dict(obj)


def bucket_megabytes(config: Any, default: int = 2048) -> int:
    """``rollout.checkpoint_engine.update_weights_bucket_megabytes`` (upstream's location), else the default."""
    ce = _get(config, "checkpoint_engine")
    value = _get(ce, "update_weights_bucket_megabytes")
    if value is None:  # older configs kept it at the rollout level
        value = _get(config, "update_weights_bucket_megabytes", default)
    return int(value)


# rollout.checkpoint_engine.backend -> the device the weight collective runs on (upstream's names; gloo is
# ours, for the CPU build). "naive" keeps the engine in the trainer's process.
SERVER_BACKENDS = {"nccl": "cuda", "hccl": "npu", "gloo": "cpu"}
_BACKEND_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"


def server_backend(config: Any, device_name: str) -> Optional[str]:
    """The collective a separate rollout server receives weights over, or None for the colocated engine.

    ``rollout.checkpoint_engine.backend``: ``naive`` (default) runs the engine inside each trainer process;
    ``nccl`` (CUDA), ``hccl`` (Ascend) and ``gloo`` (CPU hosts) start the engine as a server process that the
    trainer updates over that collective. A backend that does not match the device is refused.
    """
    backend = str(_get(_get(config, "checkpoint_engine"), "backend", "naive"))
    if backend == "naive":
        return None
    if backend not in SERVER_BACKENDS:
        raise ValueError(f"{_BACKEND_KEY}={backend!r} is not supported by the vLLM rollout; use naive (engine in "
                         f"the trainer process) or one of {sorted(SERVER_BACKENDS)} (rollout server)")
    wanted = SERVER_BACKENDS[backend]
    if wanted != device_name:
        right = {v: k for k, v in SERVER_BACKENDS.items()}[device_name]
        raise ValueError(f"{_BACKEND_KEY}={backend} needs a {wanted} device but this host runs on {device_name}; "
                         f"use {right} (or naive)")
    return backend


def check_parallel_sizes(config: Any, on_gpu: bool) -> dict:
    """vLLM engine arguments for the rollout's data / expert / pipeline parallel keys (upstream's meaning).

    ``data_parallel_size``: engine-internal data parallel replicas (vLLM ``data_parallel_size``);
    ``expert_parallel_size`` > 1: vLLM's expert parallel MoE, which must span ``tensor * data`` parallel ranks
    exactly as upstream requires; ``pipeline_model_parallel_size`` > 1 is refused (upstream refuses it for
    vLLM too). The CPU build runs one process, so any size > 1 is refused there.
    """
    tp = int(_get(config, "tensor_model_parallel_size", 1))
    dp = int(_get(config, "data_parallel_size", 1))
    ep = int(_get(config, "expert_parallel_size", 1))
    pp = int(_get(config, "pipeline_model_parallel_size", 1))
    r = "actor_rollout_ref.rollout"
    if pp != 1:
        raise ValueError(f"{r}.pipeline_model_parallel_size={pp}: pipeline parallel vLLM rollout is not "
                         "implemented (as upstream); set it to 1")
    if not on_gpu:
        moe = _get(config, "moe_tensor_parallel_size", 1) or 1
        for key, v in (("tensor_model_parallel_size", tp), ("data_parallel_size", dp), ("expert_parallel_size", ep),
                       ("moe_tensor_parallel_size", moe)):
            if v != 1:
                raise ValueError(f"{r}.{key}={v} needs GPUs/NPUs; the CPU vLLM engine runs in one process (set 1)")
        return {}
    if ep > 1 and ep != tp * dp:
        raise ValueError(f"{r}.expert_parallel_size={ep} must equal tensor_model_parallel_size * data_parallel_size "
                         f"= {tp} * {dp} (vLLM's expert parallel MoE spans all of them), or be 1")
    out: dict[str, Any] = {}
    if dp > 1:
        out["data_parallel_size"] = dp
    if ep > 1:
        out["enable_expert_parallel"] = True
    moe_tp = _get(config, "moe_tensor_parallel_size", 1)
    if moe_tp not in (None, 1):
        # Upstream accepts it for TRT-LLM only; vLLM gets it where its EngineArgs has the field.
        if "moe_tensor_parallel_size" not in vllm_engine_arg_names():
            raise ValueError(f"{r}.moe_tensor_parallel_size={moe_tp}: the installed vLLM has no "
                             "moe_tensor_parallel_size engine argument (its MoE layers shard with "
                             "tensor_model_parallel_size, or with expert_parallel_size); set it to 1")
        out["moe_tensor_parallel_size"] = int(moe_tp)
    return out


def vllm_engine_arg_names() -> frozenset[str]:
    """The fields of the installed vLLM's ``EngineArgs`` (empty when vLLM is not importable)."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def build_llm_kwargs(
    config: Any,
    model_config: Any,
    *,
    on_gpu: bool,
    is_vl: bool = False,
    seed: Optional[int] = None,
    standalone: bool = False,
    model_path: Optional[str] = None,
    in_process_group: bool = True,
) -> dict:
    """Keyword arguments for ``vllm.LLM`` from the rollout and model configs.

    ``on_gpu``: a GPU/NPU engine (sleep mode when ``free_cache_engine`` and ``enable_sleep_mode``); colocated
    with the trainer (``in_process_group``: the trainer's ``torch.distributed`` group exists) it runs one shard
    per trainer rank through vLLM's external launcher; ``standalone`` (a rollout server process) and a single
    process outside any group (a notebook, a test) let vLLM pick its executor. Otherwise the CPU build
    (single process, no sleep). ``model_path``: the checkpoint directory ``model.path`` resolved to (hub ids);
    default ``model.path``.
    """
    prompt_len = int(_get(config, "prompt_length", 512))
    response_len = int(_get(config, "response_length", 512))
    max_model_len = _get(config, "max_model_len") or prompt_len + response_len
    if max_model_len < prompt_len + response_len:
        raise ValueError(
            f"rollout.max_model_len={max_model_len} < prompt_length + response_length = {prompt_len + response_len}"
        )
    dtype = str(_get(config, "dtype", "bfloat16"))
    tp = int(_get(config, "tensor_model_parallel_size", 1))
    kw: dict[str, Any] = dict(
        model=str(model_path or _get(model_config, "path")),
        tokenizer=None,
        skip_tokenizer_init=True,  # token ids in and out; the trainer owns the tokenizer
        dtype=_DTYPE_ALIASES.get(dtype, dtype),
        tensor_parallel_size=tp,
        max_model_len=int(max_model_len),
        max_num_seqs=int(_get(config, "max_num_seqs", 256)),
        enable_chunked_prefill=bool(_get(config, "enable_chunked_prefill", True)),
        enforce_eager=bool(_get(config, "enforce_eager", True)),
        load_format=_load_format(_get(config, "load_format", "auto")),
        trust_remote_code=bool(_get(model_config, "trust_remote_code", False)),
        # Rollout log-probs after temperature / top-k / top-p, i.e. of the distribution actually sampled.
        logprobs_mode=str(_get(config, "logprobs_mode", "processed_logprobs")),
        enable_prefix_caching=bool(_get(config, "enable_prefix_caching", True)),
        seed=int(seed if seed is not None else _get(config, "seed", 0)),
    )
    mbt = _get(config, "max_num_batched_tokens")
    if mbt:
        kw["max_num_batched_tokens"] = int(mbt)
    kw.update(check_parallel_sizes(config, on_gpu))
    if on_gpu:
        kw["gpu_memory_utilization"] = float(_get(config, "gpu_memory_utilization", 0.5))
        # Upstream's RolloutConfig.enable_sleep_mode (default on); free_cache_engine decides whether to sleep.
        sleep_mode = _get(config, "enable_sleep_mode", None)  # null (the YAML's default): on
        kw["enable_sleep_mode"] = True if sleep_mode is None else bool(sleep_mode)
        if bool(_get(config, "free_cache_engine", True)) and not kw["enable_sleep_mode"]:
            raise ValueError("actor_rollout_ref.rollout.free_cache_engine=True needs enable_sleep_mode=True "
                             "(vLLM can only release memory with sleep mode on); set free_cache_engine=False")
        if not standalone and in_process_group:
            # One engine shard per trainer rank, created by torchrun/Ray workers themselves (colocated).
            kw["distributed_executor_backend"] = "external_launcher"
        elif not standalone and tp > 1:
            # vLLM would start worker processes, out of reach of the in-process weight sync.
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} needs the trainer's "
                             "process group (launch through main_ppo or torchrun); a single process runs tp=1")
    if is_vl:
        kw["language_model_only"] = True  # text rollouts: the vision tower is neither built nor synced
    from verl.workers.lora import rollout_lora_rank

    lora_rank = rollout_lora_rank(model_config)  # 0 under model.lora.merge: merged full weights arrive
    if lora_rank > 0:
        kw.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
        # With an adapter sync only the adapter travels; the frozen base must come from the checkpoint.
        if kw["load_format"] == "dummy":
            kw["load_format"] = "auto"
    if bool(_get(config, "enable_rollout_routing_replay", False)):
        # R3: vLLM records the experts of every routed token (upstream verl asks for the same argument)
        kw["enable_return_routed_experts"] = True
    kw.update(_plain(_get(_get(config, "engine_kwargs"), "vllm")))
    return {k: v for k, v in kw.items() if v is not None}


FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
_GDN_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.gdn_prefill_backend"


def without_flashinfer(kw: dict, environ: Mapping[str, str], *, linear_attention: bool,
                       gdn_backend_arg: bool) -> tuple[dict, dict, list[str]]:
    """A CUDA engine where FlashInfer is not installed: the vLLM defaults that would import it, and what runs
    instead. Returns ``(engine kwargs, environment variables to set, warnings to log)``.

    * vLLM's top-k / top-p sampler imports FlashInfer unless ``VLLM_USE_FLASHINFER_SAMPLER=0``: that is set,
      unless the user asked for FlashInfer's sampler explicitly, which is an error naming the variable.
    * vLLM's Gated DeltaNet prefill defaults to FlashInfer's kernel on Hopper (``gdn_prefill_backend=auto``):
      models with linear attention get vLLM's Triton kernel instead (``gdn_backend_arg``: the installed vLLM
      has that engine argument), with a warning, as a slower prefill must not be silent; an explicit
      ``flashinfer`` is an error naming the key.
    """
    kw, env, warnings = dict(kw), {}, []
    sampler = environ.get(FLASHINFER_SAMPLER_ENV)
    if sampler is None:
        env[FLASHINFER_SAMPLER_ENV] = "0"
        warnings.append("FlashInfer is not installed: vLLM samples top-k/top-p with its PyTorch sampler "
                        f"({FLASHINFER_SAMPLER_ENV}=0)")
    elif sampler.strip().lower() not in ("0", "false", ""):
        raise ValueError(f"{FLASHINFER_SAMPLER_ENV}={sampler} asks vLLM for FlashInfer's sampler, but flashinfer "
                         f"is not installed: install flashinfer-python (the version your vLLM names), or unset "
                         f"{FLASHINFER_SAMPLER_ENV}")
    if linear_attention and gdn_backend_arg:
        chosen = kw.get("gdn_prefill_backend")
        if chosen in (None, "auto"):
            kw["gdn_prefill_backend"] = "triton"
            warnings.append("FlashInfer is not installed: Gated DeltaNet prefill runs vLLM's Triton kernel instead "
                            "of FlashInfer's (vLLM's choice on Hopper), which may be slower; install "
                            f"flashinfer-python for it, or set {_GDN_KEY}=triton to silence this")
        elif chosen == "flashinfer":
            raise ValueError(f"{_GDN_KEY}=flashinfer, but flashinfer is not installed: install flashinfer-python, "
                             "or set it to triton")
    return kw, env, warnings


def _load_format(fmt: str) -> str:
    # Upstream's "dummy_*" formats: random init, real weights arrive with the first sync.
    return "dummy" if str(fmt).startswith("dummy") else str(fmt)


def vllm_sampling_kwargs(params: SamplingParams) -> dict:
    """Our :class:`SamplingParams` as ``vllm.SamplingParams`` keyword arguments."""
    top_k = int(params.top_k)
    kw = dict(
        n=int(params.n),
        temperature=0.0 if params.greedy else float(params.temperature),
        top_p=1.0 if params.greedy else float(params.top_p),
        top_k=-1 if top_k <= 0 else top_k,  # 0 and -1 both mean "no top-k"
        max_tokens=int(params.max_tokens),
        stop_token_ids=list(params.stop_token_ids),
        # Our stop ids are the whole list (the EOS ids included unless rollout.ignore_eos): vLLM must not add the
        # checkpoint's generation-config EOS ids to them on its own, or rollout.ignore_eos=true would not hold.
        ignore_eos=True,
        seed=params.seed,
        logprobs=0 if params.logprobs else None,  # 0: just the sampled token's log-prob
        detokenize=False,
    )
    return kw


def to_generation_outputs(request_output: Any, want_logprobs: bool, want_routes: bool = False) -> list[GenerationOutput]:
    """One vLLM ``RequestOutput`` -> our outputs (one per sample). ``want_routes``: the engine was built with
    ``enable_return_routed_experts`` (rollout.enable_rollout_routing_replay) and each sample carries its routes."""
    outs = []
    n_prompt = len(request_output.prompt_token_ids or []) if want_routes else 0
    for c in request_output.outputs:
        ids = list(c.token_ids)
        lps = None
        if want_logprobs:
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no per-token log-probs although they were requested")
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
        reason = c.finish_reason or "length"
        routes = routes_from_vllm(getattr(c, "routed_experts", None), n_prompt + len(ids)) if want_routes else None
        outs.append(GenerationOutput(ids, lps, "stop" if reason == "stop" else reason, routed_experts=routes))
    return outs


def check_every_layer_routes(hf_config) -> None:
    """vLLM's routes have one row per decoder layer, the trainer's replay one per MoE layer: the two agree only for
    a model whose every decoder layer is MoE (Qwen3.5 MoE, Qwen3-MoE with the defaults). Anything else is refused
    here rather than replayed onto the wrong layers."""
    from verl.models.spec import get_text_config

    text = get_text_config(hf_config)
    if not int(getattr(text, "num_experts", 0) or 0):
        raise ValueError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true needs a MoE model; "
                         f"{type(hf_config).__name__} has no experts")
    dense = list(getattr(text, "mlp_only_layers", None) or [])
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    if dense or step != 1 or getattr(text, "first_k_dense_replace", 0):
        raise ValueError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true with rollout.name=vllm needs "
                         "every decoder layer to be MoE (vLLM returns one route row per decoder layer); this model "
                         f"has dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}): use rollout.name=hf")


def routes_from_vllm(routed: Any, n_tokens: int) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` (numpy ``[routed tokens, moe layers, top_k]``, in the narrowest
    integer dtype that holds the expert ids, e.g. uint8) -> this package's layout: a signed (prompt + response
    tokens, moe layers, top_k) tensor, -1 on the rows vLLM did not route (the last sampled token is never fed
    back through the model)."""
    if routed is None:
        raise RuntimeError("rollout.enable_rollout_routing_replay=true, but vLLM returned no routed_experts for a "
                           "sample (the engine was built with enable_return_routed_experts=True)")
    r = torch.as_tensor(np.asarray(routed).astype(np.int64)).to(torch.int16)
    if r.dim() != 3 or r.shape[0] > n_tokens:
        raise RuntimeError(f"vLLM returned routed_experts of shape {tuple(r.shape)} for a sequence of {n_tokens} "
                           "tokens; expected (at most that many tokens, moe layers, top_k)")
    out = torch.full((n_tokens, *r.shape[1:]), -1, dtype=torch.int16)
    out[: r.shape[0]] = r
    return out


def spmd_ranks(llm_kwargs: dict) -> int:
    """Trainer ranks that share one colocated engine (external launcher): tensor x pipeline parallel size. A
    rank-private engine (no external launcher) is one rank's alone."""
    if llm_kwargs.get("distributed_executor_backend") != "external_launcher":
        return 1
    return int(llm_kwargs.get("tensor_parallel_size", 1)) * int(llm_kwargs.get("pipeline_parallel_size", 1))
