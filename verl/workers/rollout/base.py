"""The one interface every rollout engine implements (hf built in; vLLM and SGLang as optional extras).

Token ids go in; token ids, per-token rollout log-probs and finish reasons come out. Engines know nothing
about DataProto, padding or the trainer: ``verl.workers.rollout.batching`` turns a prompt batch into
engine requests and engine outputs back into the trainer's tensors, so every engine shares that logic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from verl.utils.registry import Registry


@dataclass
class SamplingParams:
    """Per-call sampling settings; ``top_k`` of 0 or -1 disables top-k, ``temperature`` 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: Optional[int] = None
    # Return log-probs of the sampled tokens (after temperature scaling, like vLLM's processed_logprobs).
    logprobs: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationOutput:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    finish_reason: str = "length"  # "stop" (EOS or stop id), "length" (max_tokens) or "abort"
    # rollout.enable_rollout_routing_replay: (prompt + response tokens, moe_layers, top_k) expert ids; -1 where
    # the engine did not route the token (the last response token)
    routed_experts: Optional[Any] = None


@dataclass
class GenerationRequest:
    """One prompt: its token ids and, for vision-language models, the processor outputs for its images."""

    prompt_token_ids: list[int]
    multi_modal_data: Optional[dict[str, Any]] = None
    # Rows with videos: the prompt as the processor expanded it (per-frame timestamps + vision tokens), for engines
    # that take expanded prompts (the built-in hf rollout); engines that expand themselves (vLLM) ignore it.
    expanded_prompt_token_ids: Optional[list[int]] = None


class BaseRollout(ABC):
    """A generation engine. Constructed on the worker that owns the actor (colocated hybrid engine)."""

    #: True for engines that generate with the actor's own module (built with ``module=``, no weight copies: the
    #: worker hands them the actor engine's ``hf_rollout_module()`` and syncs that module instead of streaming).
    generates_with_training_module: bool = False
    #: How many consecutive trainer ranks run one engine instance together (SPMD: vLLM's tensor / pipeline
    #: parallelism under its external launcher). Every rank of such a block must be handed the same requests;
    #: the worker regroups the dispatched prompts for it (``verl.workers.sp_regroup.compute_in_group``).
    spmd_ranks: int = 1
    #: A rollout pool of its own (the asynchronous modes) keeps several chunks in flight in one decode session and
    #: installs weights while they decode (partial rollout) through this class, constructed as ``cls(rollout,
    #: rollout_cfg, eos_ids, pad_token_id)`` with ``pending / submit / ready / swap_weights / collect``
    #: (:class:`verl.workers.rollout.pipelined.ChunkPipeline` is the built-in engine's); None: this engine
    #: generates one chunk per call.
    chunk_pipeline_class: Optional[type] = None

    @abstractmethod
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        """Sample ``params.n`` continuations for each request; returns one list of outputs per request."""

    @abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        """Load new weights given as (HF parameter name, full tensor) pairs.

        Keyword ``lora`` (a dict with ``peft_config`` and ``lora_int_id``) marks the tensors as a LoRA adapter.
        """

    def sleep(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Release device memory held for the given tags (no-op for engines without sleep support)."""

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Re-acquire what :meth:`sleep` released."""


# name -> engine class, or dotted path of one (or of a factory with the same signature: vLLM picks colocated vs
# server mode from ``rollout.checkpoint_engine.backend``); dotted paths are imported on first use so heavy
# engines stay optional.
ROLLOUT_REGISTRY = Registry(
    "rollout engine",
    config_key="actor_rollout_ref.rollout.name",
    extras={"vllm": "vllm", "sglang": "sglang"},
)
ROLLOUT_REGISTRY.register("hf", "verl.workers.rollout.hf_rollout.HFRollout")
ROLLOUT_REGISTRY.register("vllm", "verl.workers.rollout.vllm_rollout.create_vllm_rollout")


def register_rollout(name: str, qualified_class_name, *, override: bool = False) -> None:
    """Make ``actor_rollout_ref.rollout.name=<name>`` resolve to a user-provided engine (class or dotted path)."""
    ROLLOUT_REGISTRY.register(name, qualified_class_name, override=override)


def get_rollout_class(name: str):
    """The engine constructor for ``name``: called as ``(config, model_config, tokenizer, module, processor)``."""
    return ROLLOUT_REGISTRY.get_or_raise(name)
