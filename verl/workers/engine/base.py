"""The training-engine interface: what actor, reference, critic and the SFT trainer need from a backend.

An engine owns one model's weights, its optimizer and LR scheduler, and its parallel layout (FSDP2 data
parallel + Ulysses; Megatron TP/PP/CP/EP + distributed optimizer). Roles never touch the model directly:
they hand the engine a batch and, for training, a loss function, and get per-token outputs and metrics
back. So one actor/critic/SFT code path runs on every backend.

Data contract
-------------
A batch is a :class:`verl.DataProto` whose ``batch`` holds right-padded ``input_ids``, ``attention_mask``,
``position_ids`` ((B, L), or (B, C, L) for mRoPE) plus whatever the loss function reads (``responses``,
``response_mask``, ``advantages``, ``loss_mask`` ...); ``non_tensor_batch["multi_modal_inputs"]`` carries
per-row processor outputs for VL. ``meta_info`` carries ``micro_batch_size`` (per rank), or
``use_dynamic_bsz`` + ``max_token_len`` (per rank), and ``temperature``.

The engine splits the batch into micro-batches (packing each one when remove-padding is on), runs the
model and returns, for every micro-batch, the model outputs in the padded (B, L) layout, aligned so that
position ``t`` holds the value for predicting token ``t + 1`` (``log_probs``, ``entropy``) or the value
at token ``t`` (``values``). Roles slice what they need (``response_slice``).

A loss function is ``loss_fn(outputs: dict[str, Tensor], micro_batch: dict[str, Tensor]) -> (loss, metrics)``;
the engine calls ``loss.backward()`` (through the pipeline schedule on Megatron). It must already be
normalised by global (whole mini-batch, all DP ranks) counts, which the engine passes in
``micro_batch["global_batch_info"]`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``), so that
the gradient does not depend on how the batch was split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from verl.protocol import DataProto
from verl.utils.registry import Registry
from verl.workers.engine.role import EngineRole, engine_role

LossFn = Callable[[dict, dict], "tuple[torch.Tensor, dict[str, float]]"]

__all__ = ["BaseEngine", "EngineRegistry", "LossFn", "accumulate_metrics", "response_slice"]


def response_slice(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, L) next-token-aligned values -> the (B, R) values of the response tokens (the last R of L)."""
    return values[:, -response_length - 1 : -1]


def accumulate_metrics(per_micro_batch: list[dict], summed: Iterable[str] = ()) -> dict[str, float]:
    """Combine the loss function's metrics over the micro-batches of one mini-batch.

    Keys in ``summed`` (the loss function's ``summed_metrics`` attribute) are added up: losses already
    normalised by global counts, whose per-micro-batch shares sum to the mini-batch value. Every other key
    (ratios such as clip fractions) is averaged over the micro-batches that reported it."""
    summed = set(summed)
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in per_micro_batch:
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    return {k: v if k in summed else v / counts[k] for k, v in totals.items()}


class BaseEngine(ABC):
    """One model + optimizer + scheduler on one backend. Constructed on every rank of a worker group."""

    #: ``"actor"`` (policy, trainable), ``"ref"`` (frozen policy), ``"critic"`` (value model) or ``"sft"``.
    role: str

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any = None,
                 checkpoint_config: Any = None, role: str = "actor", **kwargs):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.role = role

    @property
    def role_spec(self) -> EngineRole:
        """What the role asks of the engine (output head, loss output, trainable): :mod:`verl.workers.engine.role`."""
        return engine_role(self.role)

    # ---------------------------------------------------------------- life cycle
    @abstractmethod
    def initialize(self) -> None:
        """Build (load) the model, shard it, build optimizer and scheduler (trainable roles only)."""

    @contextmanager
    def train_mode(self):
        """Context for training passes (dropout on, weights on device if offloaded)."""
        yield

    @contextmanager
    def eval_mode(self):
        """Context for inference passes (no grad, weights on device if offloaded)."""
        yield

    # ---------------------------------------------------------------- compute
    @abstractmethod
    def forward_backward_batch(self, data: DataProto, loss_fn: Optional[LossFn] = None,
                               forward_only: bool = False, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """Run every micro-batch of ``data``; backward through ``loss_fn`` unless ``forward_only``.

        Returns ``{"outputs": {name: (B, L) tensor in the original row order, on CPU}, "metrics": {...}}``
        where the metrics are the loss function's, summed over micro-batches for keys the loss marks as
        sums and averaged otherwise (see ``accumulate_metrics``)."""

    def infer_batch(self, data: DataProto, outputs: tuple[str, ...] = ("log_probs",)) -> dict[str, torch.Tensor]:
        """Forward only: the requested per-token outputs, (B, L), original order, on CPU."""
        with self.eval_mode():
            return self.forward_backward_batch(data, None, forward_only=True, outputs=outputs)["outputs"]

    def train_batch(self, data: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        """One optimizer step over ``data`` (a mini-batch): zero grads, forward/backward, clip, step.

        Returns the loss metrics plus ``grad_norm``. A non-finite grad norm skips the step (logged)."""
        with self.train_mode():
            self.optimizer_zero_grad()
            result = self.forward_backward_batch(data, loss_fn, forward_only=False, outputs=outputs)
            grad_norm = self.optimizer_step()
        metrics = dict(result["metrics"])
        metrics["grad_norm"] = grad_norm
        return metrics

    # ---------------------------------------------------------------- optimizer
    @abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to ``optim.clip_grad`` (or the role's ``grad_clip``), step; returns the grad norm."""

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the scheduler one step; returns the LR that the step just taken used."""

    # ---------------------------------------------------------------- weights
    @abstractmethod
    def get_per_tensor_param(self, bucket_megabytes: float = 512, layered: bool = False
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights with Hugging Face names, one tensor at a time, for rollout weight sync
        and HF export. Every rank must drive the iterator to the end (gathering is collective)."""

    def get_rollout_weights(self, bucket_megabytes: float = 512, layered: bool = False
                            ) -> "tuple[Iterator[tuple[str, torch.Tensor]], dict]":
        """``(weights, update_weights kwargs)`` for a rollout engine that loads weights (vLLM).

        Full weights and no kwargs by default; an engine training a LoRA adapter may send the adapter alone
        (PEFT-named tensors with ``{"lora": {"peft_config", "lora_int_id"}}``) where the rollout can apply it."""
        return self.get_per_tensor_param(bucket_megabytes=bucket_megabytes, layered=layered), {}

    def hf_rollout_module(self) -> torch.nn.Module:
        """The Hugging Face module the ``hf`` rollout generates with: the training module itself by default
        (FSDP); an engine whose model is not an HF module (Megatron) returns a copy it keeps in sync."""
        return self.module

    def sync_hf_rollout_module(self) -> None:
        """Bring :meth:`hf_rollout_module` up to date after an update or a checkpoint load (collective);
        nothing to do when it is the training module."""

    def release_hf_rollout_module(self) -> bool:
        """Free the device memory of :meth:`hf_rollout_module`'s parameters until the next
        :meth:`sync_hf_rollout_module`, which re-allocates and refills them; True when something was freed.
        Nothing to free when the rollout generates with the training module itself."""
        return False

    # ---------------------------------------------------------------- checkpoints
    @abstractmethod
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: Optional[int] = None) -> None: ...

    @abstractmethod
    def load_checkpoint(self, local_path: str) -> None: ...

    # ---------------------------------------------------------------- memory
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move model parameters, optimizer state and/or gradients to ``"cpu"`` or ``"device"`` (the
        accelerator), so a colocated rollout engine can use the memory between phases. No-op by default."""

    # ---------------------------------------------------------------- topology
    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def dp_group(self):
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        """Whether this rank's outputs are the ones to collect (last PP stage, TP/CP rank 0)."""
        return True

    @property
    def module(self) -> torch.nn.Module:
        """The underlying model (the HF module on FSDP; the mcore module list on Megatron)."""
        raise NotImplementedError

    def model_hf_config(self):
        """The Hugging Face config of the model this engine trains (FLOPs formulas and model specs read it)."""
        return getattr(self.module, "config", None)


# backend name -> engine class (or its dotted path, imported when first used, so megatron-core stays an
# optional extra). Keys are the values users set in ``actor_rollout_ref.actor.strategy`` / ``critic.strategy``
# / the SFT trainer's ``engine``; ``fsdp`` is an alias of ``fsdp2`` (the only FSDP this project builds).
EngineRegistry = Registry("training engine", config_key="strategy", extras={"megatron": "mcore"},
                          aliases={"fsdp": "fsdp2"})
