"""Colocated vLLM rollout engine (``actor_rollout_ref.rollout.name=vllm``).

The engine lives in the trainer's process: on GPU/NPU one shard per trainer rank through vLLM's external
launcher (tensor parallel across the ranks of a rollout group), with sleep mode to hand memory back during
training; on the CPU build a single in-process engine without sleep mode.

Weight sync is the layerwise in-place reload (``worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)``): the engine's own HF-name loader (the model's ``load_weights``, or a loader
registered in :mod:`verl.models.dtensor_weight_loader`) fuses and shards the HF tensors, so any causal LM
vLLM supports syncs, the trainer streams full HF-named tensors bucket by bucket and the engine never holds a
second copy. Coverage is what that loader reports loaded (:func:`~verl.workers.weight_sync.check_loader_coverage`),
plus the shard-level rules of the Qwen3.5 / vLLM-Ascend layouts. Layers that share a parameter (tied LM
heads) are re-processed after each reload (:mod:`verl.utils.vllm.reload`). LoRA adapters go through a
directory in PEFT's saved format and a ``LoRARequest`` (vLLM has no tensor-based LoRA request).

Sleep mode (``free_cache_engine`` with ``enable_sleep_mode``, CUDA only in vLLM; vLLM-Ascend on NPU): the
worker calls :meth:`vLLMRollout.sleep` before the actor update and wakes weights, syncs, then wakes the KV
cache before generating (:class:`verl.workers.weight_sync.cycle.RolloutCycle`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Iterable, Optional

import torch

from verl.utils.device import get_device_name, get_torch_device, is_vllm_ascend_available
from verl.workers.rollout.base import BaseRollout, GenerationOutput, GenerationRequest, SamplingParams
from verl.workers.weight_sync import (
    EngineLayout,
    check_coverage,
    check_loader_coverage,
    to_engine_loader_format,
    write_lora_adapter,
)

from .engine_args import (
    bucket_megabytes,
    build_llm_kwargs,
    check_every_layer_routes,
    spmd_ranks,
    to_generation_outputs,
    vllm_sampling_kwargs,
    without_flashinfer,
)

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "vLLM is not installed; install the extra with `pip install -e .[vllm]` "
    "(CPU tests: bash scripts/setup_vllm_env.sh)"
)


def import_vllm():
    """``vllm`` module, or an ImportError naming the extra to install."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return vllm


def _accelerator() -> Optional[str]:
    name = get_device_name()
    return None if name == "cpu" else name


def sync_layout(hf_config, engine_names, *, ascend: bool) -> Optional[EngineLayout]:
    """The name rules a full sync applies before the engine's loader: the layout class the model spec names
    (``ModelSpec.weight_sync_layout``; Qwen3.5's covers the vision tower, MTP head, tied head, shard-level
    coverage, and per-expert checkpoint names on vLLM-Ascend, whose MoE loader needs them), or None for an
    architecture whose spec names none (its tensors go to vLLM's loader untouched)."""
    from verl.models.registry import get_model_spec

    layout_cls = get_model_spec(hf_config).resolve("weight_sync_layout")
    if layout_cls is None:
        return None
    fmt = "per_expert" if ascend else "fused"
    layout = layout_cls.from_hf_config(hf_config, language_model_only=True, expert_format=fmt)
    return layout.matching_engine(engine_names)


def uses_runtime_expert_writer(layout: Optional[EngineLayout], *, ascend: bool, standalone: bool) -> bool:
    """vLLM-Ascend MoE, colocated: fused experts are written straight into the post-processed runtime layout.
    A server (``standalone``) reloads them through the checkpoint loader and post-processes instead."""
    return ascend and layout is not None and layout.moe and not standalone


def _reload_unwraps_lora() -> bool:
    """Whether this vLLM's in-place reload maps checkpoint names onto LoRA-wrapped layers itself (0.32 does,
    through ``reload.inplace.get_parameter_for_reload``; 0.26 does not, and its loader then fails on names such
    as ``conv1d.weight`` of a wrapped ``conv1d``)."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload  # noqa: F401
    except ImportError:
        return False
    return True


def _launched_rank() -> bool:
    """Whether this process is a rank of a launched job (torchrun, the Ray / in-process workers): its process
    group is up and the variables vLLM's external launcher reads are set. A group left behind by an earlier
    engine in the same process (vLLM initialises one for itself) does not count."""
    return torch.distributed.is_initialized() and all(
        k in os.environ for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _device_memory_used_gb() -> Optional[float]:
    """GiB in use on this process's CUDA device, by every allocator and process (None off CUDA)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


class vLLMRollout(BaseRollout):
    """``BaseRollout`` on ``vllm.LLM``; see the module docstring."""

    def __init__(self, config, model_config, tokenizer, module=None, processor=None, *, standalone: bool = False):
        """``standalone``: this engine is a rollout server's (server mode), not a shard inside a trainer rank."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.processor = processor
        self.device = _accelerator()
        self.ascend = self.device == "npu" and is_vllm_ascend_available()
        # Server mode: every full sync is a reload through the checkpoint loader (never the colocated
        # runtime-layout writes), so vLLM-Ascend MoE layers are post-processed after it.
        self.full_reload = standalone
        self.bucket_megabytes = bucket_megabytes(config)
        self.layered_summon = bool(config.get("layered_summon", False)) if hasattr(config, "get") else False
        # The engine must run in this process: weights stream through a Python iterator.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("the colocated vLLM rollout needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

        from transformers import AutoConfig

        from verl.utils.model_path import model_config_dir

        # A hub id becomes its directory in the HF cache, as for the trainer (the engine and sync read files).
        path = model_config_dir(model_config)
        trust = bool(model_config.get("trust_remote_code", False))
        self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        is_vl = hasattr(self.hf_config, "vision_config")
        from verl.workers.lora import rollout_lora_rank

        self.lora_rank = rollout_lora_rank(model_config)
        kwargs = build_llm_kwargs(config, model_config, on_gpu=self.device is not None, is_vl=is_vl,
                                  standalone=standalone, model_path=path,
                                  in_process_group=_launched_rank())
        self.free_cache_engine = bool(config.get("free_cache_engine", True)) if hasattr(config, "get") else True
        self.spmd_ranks = spmd_ranks(kwargs)
        self.record_routes = bool(kwargs.get("enable_return_routed_experts", False))
        if self.record_routes:
            check_every_layer_routes(self.hf_config)
        self.llm = self._create_engine(kwargs)
        self._sleep_supported = self._sleep_mode_available() and kwargs.get("enable_sleep_mode", False)
        if self.free_cache_engine and not self._sleep_supported:
            logger.warning("rollout.free_cache_engine=True but vLLM sleep mode is unavailable here (%s): the engine "
                           "keeps its weights and KV cache through training", self.device or "CPU build")
        self._engine_names = self._engine_param_names()
        from verl.models.dtensor_weight_loader import get_weight_loader

        self.custom_loader = get_weight_loader(getattr(self.hf_config, "architectures", None))
        self.layout = sync_layout(self.hf_config, self._engine_names, ascend=self.ascend)
        self._lora_request = None
        self._lora_dir = tempfile.mkdtemp(prefix="verl_vllm_lora_")
        self._lora_version = 0
        self.is_sleeping = False
        self.last_stats: dict[str, float] = {}  # the chunk pipeline's, for engine_metrics
        self.memory_metrics: dict[str, float] = {}  # device memory around the last sleep (CUDA), for the worker

    # ------------------------------------------------------------------ engine plumbing
    def _create_engine(self, kwargs: dict):
        vllm = import_vllm()
        from verl.utils.vllm.rope_patch import rope_ignore_keys_as_set

        from .plugin import register

        register()  # the text-only architectures vLLM lacks (a no-op where the plugin entry point ran already)
        if self.device == "cuda":
            kwargs = self._without_missing_kernels(kwargs)

        if self.ascend:
            from verl.utils.vllm.ascend_moe import require_nz_disabled
            from verl.utils.vllm.npu_vllm_patch import apply_npu_vllm_patches

            if kwargs.get("enable_sleep_mode"):
                require_nz_disabled()
            apply_npu_vllm_patches(self.hf_config)
        if kwargs.get("enable_return_routed_experts"):
            from packaging.version import Version

            # vLLM's route recorder is right for hybrid-attention MoE models (Qwen3.5) from 0.22 on; older releases
            # lack it or under-size its host buffer
            if Version(vllm.__version__).release < (0, 22):
                raise RuntimeError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true needs vLLM >= 0.22 "
                                   f"(its routed-experts recorder); installed: {vllm.__version__}")
        logger.info("creating vLLM engine: %s", {k: v for k, v in kwargs.items() if k != "model"})
        with rope_ignore_keys_as_set():
            try:
                return vllm.LLM(**kwargs)
            except Exception as exc:
                if not kwargs.get("enable_return_routed_experts"):
                    raise
                # e.g. vLLM 0.32's CPU build: "AuxOutput Connector requires Model Runner V2" / "... requires Triton"
                raise RuntimeError("actor_rollout_ref.rollout.enable_rollout_routing_replay=true asks vLLM to return "
                                   "the routed experts (enable_return_routed_experts=True), and this vLLM refused to "
                                   f"build such an engine: {exc}") from exc

    def _without_missing_kernels(self, kwargs: dict) -> dict:
        """vLLM's CUDA defaults that import FlashInfer, replaced (with a warning) where it is not installed."""
        import dataclasses
        import importlib.util

        if importlib.util.find_spec("flashinfer") is not None:
            return kwargs
        from vllm.engine.arg_utils import EngineArgs

        from verl.models.registry import get_model_spec

        kwargs, env, warnings = without_flashinfer(
            kwargs, os.environ, linear_attention=get_model_spec(self.hf_config).has_linear_attention,
            gdn_backend_arg="gdn_prefill_backend" in {f.name for f in dataclasses.fields(EngineArgs)})
        os.environ.update(env)
        for w in warnings:
            logger.warning(w)
        return kwargs

    def _sleep_mode_available(self) -> bool:
        from vllm.platforms import current_platform

        check = getattr(current_platform, "is_sleep_mode_available", None)
        return bool(check()) if check is not None else False

    @property
    def worker(self):
        executor = self.llm.llm_engine.model_executor
        return executor.driver_worker.worker

    @property
    def engine_model(self) -> torch.nn.Module:
        # The model itself, not the CUDA-graph wrapper vLLM puts around it when graphs are on: the reload calls
        # the model's own load_weights, which LoadedNames has to see.
        runner = self.worker.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _engine_param_names(self) -> set[str]:
        # With LoRA enabled, vLLM wraps layers and their weights gain a ``base_layer.`` segment.
        return {n.replace(".base_layer.", ".") for n, _ in self.engine_model.named_parameters()}

    # ------------------------------------------------------------------ generation
    @property
    def chunk_pipeline_class(self):
        """Chunks in flight (a rollout pool of its own): where this rank's engine is its alone (no ranks sharing
        it in lock step), and no routes are recorded (a resubmitted response would need its routes stitched)."""
        if self.spmd_ranks != 1 or self.record_routes or self.lora_rank > 0:
            return None
        from .pipeline import VLLMChunkPipeline

        return VLLMChunkPipeline

    @property
    def engine_metrics(self) -> dict:
        """The chunk pipeline's figures since its previous collect (engine steps, weight swaps with requests in
        flight, resubmitted responses and their re-prefilled tokens); empty after a plain ``generate``."""
        return {f"perf/vllm/{k}": float(v) for k, v in self.last_stats.items()}

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        vllm = import_vllm()
        self.last_stats = {}
        if self.is_sleeping:
            raise RuntimeError("vLLM rollout is asleep; call wake_up() before generate()")
        prompts = []
        for r in requests:
            p: dict[str, Any] = {"prompt_token_ids": list(r.prompt_token_ids)}
            if r.multi_modal_data:
                p["multi_modal_data"] = r.multi_modal_data
            prompts.append(p)
        sp = vllm.SamplingParams(**vllm_sampling_kwargs(params))
        outs = self.llm.generate(prompts, sp, use_tqdm=False, lora_request=self._lora_request)
        return [to_generation_outputs(o, params.logprobs, want_routes=self.record_routes) for o in outs]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Engine log-probs of each token of each sequence given its prefix (first token excluded).

        Temperature 1, no top-k/top-p: comparable to the trainer's ``log_softmax`` of the logits.
        """
        vllm = import_vllm()
        sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate(
            [{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False, lora_request=self._lora_request
        )
        result = []
        for seq, o in zip(sequences, outs):
            steps = o.prompt_logprobs[1:]
            result.append([float(step[t].logprob) for step, t in zip(steps, seq[1:])])
        return result

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        lora = kwargs.get("lora")
        if lora:
            self._load_lora(weights, lora)
            return
        from verl.utils.vllm.reload import (
            LoadedNames,
            lora_base_layer_renamer,
            refresh_aliased_layers,
            resolve_delegated_names,
            repack_cpu_moe_experts,
            routed_experts_without_lora_prefix,
        )

        sent: list[str] = []  # HF names handed on (to the loader or the runtime-layout writer)
        layout = self.layout
        # None unless LoRA wrapped the layers and this vLLM's reload does not resolve the wrappers itself
        wrapped_name = None if _reload_unwraps_lora() else lora_base_layer_renamer(self.engine_model)
        writer = None
        if uses_runtime_expert_writer(layout, ascend=self.ascend, standalone=self.full_reload):
            writer = self._ascend_expert_writer()

        def stream():
            for name, tensor in weights:
                if writer is not None and writer.offer(name, tensor):
                    sent.append(name)  # written straight into the runtime layout, kept away from the loader
                    continue
                pairs = [(name, tensor)] if layout is None else to_engine_loader_format([(name, tensor)], layout)
                for n, t in pairs:
                    sent.append(n)
                    yield (n if wrapped_name is None else wrapped_name(n)), t

        model = self.engine_model
        with LoadedNames(model, loader=self.custom_loader) as loaded, routed_experts_without_lora_prefix(model):
            self.worker.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
        if writer is not None:
            self._finish_ascend_experts(writer)
        elif self.ascend and layout is not None and layout.moe:
            self._post_process_reloaded_experts()
        refresh_aliased_layers(model)  # tied LM head: re-derive what its processing cached from the old weights
        if self.device is None:
            repack_cpu_moe_experts(model)  # the CPU build's MoE kernel needs its packed expert layout back
        reported = None
        if loaded.reported:
            reported = resolve_delegated_names(loaded.names, self._engine_names)
            reported |= set(writer.param_names if writer is not None else ())
        check_loader_coverage(self._engine_names, reported, sent)
        if layout is not None and self.custom_loader is None:
            check_coverage(self._engine_names, sent, layout)
        self._weights_discarded = False
        # Cached prefixes hold KV computed with the old weights.
        self.llm.reset_prefix_cache()

    def _moe_layers(self) -> list:
        return [m for m in self.engine_model.modules() if hasattr(m, "w13_weight") and hasattr(m, "quant_method")]

    def _post_process_reloaded_experts(self) -> None:
        """Full reload on vLLM-Ascend (server mode): expert layers that the loader left in checkpoint layout are
        post-processed into the runtime layout again; layers vLLM's layerwise reload already processed are not
        touched (a second pass would transpose them back)."""
        from verl.utils.vllm.ascend_moe import CHECKPOINT, PostLoadGuard, layout_of

        text = getattr(self.hf_config, "text_config", self.hf_config)
        hidden = int(text.hidden_size)
        pending = [m for m in self._moe_layers() if layout_of(m, hidden) == CHECKPOINT]
        PostLoadGuard("reload").after_load(pending, lambda layer: layer.quant_method.process_weights_after_loading(layer))

    def _ascend_expert_writer(self):
        """vLLM-Ascend colocated path: fused HF experts go straight into the post-processed runtime layout."""
        from vllm.distributed import parallel_state as ps

        from verl.utils.vllm.ascend_moe import RuntimeExpertWriter

        text = getattr(self.hf_config, "text_config", self.hf_config)
        return RuntimeExpertWriter(
            self.engine_model,
            hidden_size=int(text.hidden_size),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            experts_path=self.layout.engine_experts_path,
        )

    @staticmethod
    def _finish_ascend_experts(writer) -> None:
        from verl.utils.vllm.ascend_moe import PostLoadGuard

        writer.finish()

        def post_process(layer):
            layer.quant_method.process_weights_after_loading(layer)

        # Layers written in runtime layout are skipped: a second post-process would transpose them back.
        PostLoadGuard("colocated").after_load(writer.layers, post_process)

    def _load_lora(self, weights, lora: dict) -> None:
        lora_id = int(lora.get("lora_int_id", 1))
        self._lora_version += 1
        path = os.path.join(self._lora_dir, f"v{self._lora_version}")
        write_lora_adapter(path, weights, lora["peft_config"])
        from vllm.lora.request import LoRARequest

        if self._lora_request is not None:
            # Same id, new tensors: drop the cached adapter so the next request loads the new directory.
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._lora_request = LoRARequest(f"verl_lora_{lora_id}", lora_id, path)
        self.llm.llm_engine.add_lora(self._lora_request)

    # ------------------------------------------------------------------ memory
    @property
    def sleeps(self) -> bool:
        """Whether :meth:`sleep` releases memory (``free_cache_engine`` and a platform with sleep mode)."""
        return self.free_cache_engine and self._sleep_supported

    @property
    def weights_lost_in_sleep(self) -> bool:
        """A level-2 sleep discarded the weights and no full sync has refilled them yet."""
        return self._weights_discarded

    _weights_discarded = False

    def sleep(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        if not self.sleeps or self.is_sleeping:
            return
        # Level 1 keeps a CPU copy of the weights (needed when only a LoRA adapter is re-synced);
        # level 2 drops them, as a full sync follows the next wake-up.
        level = 1 if self.lora_rank > 0 or "weights" not in tags else 2
        used_before = _device_memory_used_gb()
        self.llm.sleep(level=level)
        if used_before is not None:
            # Whole-device figures (vLLM's CuMem pool is invisible to torch's allocator statistics).
            self.memory_metrics = {"perf/rollout_device_memory_before_sleep_gb": used_before,
                                   "perf/rollout_device_memory_after_sleep_gb": _device_memory_used_gb()}
        self._weights_discarded = level == 2
        self.is_sleeping = True
        self._awake: set[str] = set()

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        if not self.sleeps or not self.is_sleeping:
            return
        if self.ascend:
            # Re-checked at every wake: an NZ-format engine cannot be refilled (see ascend_moe).
            from verl.utils.vllm.ascend_moe import require_nz_disabled

            require_nz_disabled()
        # The trainer's caching allocator still holds what the update freed (78.5 GiB reserved after a 0.8B
        # update on an H100 with the engine asleep): hand it back, or vLLM cannot map its memory again
        # (seen: "CUDA Error: out of memory at cumem_allocator.cpp" on the second step's wake-up).
        get_torch_device().empty_cache()
        self.llm.wake_up(tags=list(tags))
        self._awake.update(tags)
        if self._awake >= {"weights", "kv_cache"}:
            self.is_sleeping = False

    def shutdown(self) -> None:
        """Tear the engine down, including vLLM's process-global parallel state (so another engine, e.g. a
        different model, can be created in this process)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core") and hasattr(engine.engine_core, "shutdown"):
                engine.engine_core.shutdown()
            del llm
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        import gc

        gc.collect()
        shutil.rmtree(self._lora_dir, ignore_errors=True)

    def __del__(self):  # best effort: adapters are rewritten on every LoRA sync
        d = getattr(self, "_lora_dir", None)
        if d:
            shutil.rmtree(d, ignore_errors=True)
