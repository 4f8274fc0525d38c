"""FSDP2 workers: the hybrid actor + rollout + reference worker, and the critic worker.

One process per device hosts these roles (colocated); the controller calls the methods marked with
``register`` through a worker group, which splits DataProto batches by data-parallel rank.
"""

from __future__ import annotations

import logging
import os
import random
import time

import numpy as np

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.worker import Worker
from verl.utils.device import get_device_name
from verl.workers.model_builder import build_optimizer_and_scheduler, load_tokenizer_and_processor, shard_model

logger = logging.getLogger(__name__)


def _per_rank(total: int, world: int, name: str) -> int:
    if total % world != 0:
        raise ValueError(f"{name}={total} must be divisible by the data-parallel size {world}")
    return total // world


class ActorRolloutRefWorker(Worker):
    """``role`` is ``actor_rollout_ref`` (all three), ``actor_rollout``, ``actor`` or ``ref``."""

    def __init__(self, config: DictConfig, role: str = "actor_rollout_ref", full_config: DictConfig | None = None):
        super().__init__()
        self.config = config  # the actor_rollout_ref section
        # The whole config, for parts that read other sections (the agent loop reads data.* and multi_turn).
        self.full_config = full_config if full_config is not None else OmegaConf.create({"actor_rollout_ref": config})
        self.role = role
        self._is_actor = "actor" in role
        self._is_rollout = "rollout" in role
        self._is_ref = "ref" in role
        self.device = get_device_name()

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        self.ensure_process_group()
        cfg = self.config
        world = dist.get_world_size()
        sp = int(cfg.actor.get("ulysses_sequence_parallel_size", 1))
        self.dp_size = world // sp
        self.dp_rank = self.rank // sp  # consecutive ranks form one sequence-parallel group
        self.sp_group = self._build_sp_group(world, sp)
        self.tokenizer, self.processor = load_tokenizer_and_processor(cfg.model)
        self._normalize_batch_sizes()
        if self._is_actor:
            built = shard_model(cfg.model, cfg.actor.fsdp_config, role="actor", ulysses_sp_size=sp,
                                enable_gc=cfg.model.get("enable_gradient_checkpointing", False))
            self.actor_module, self.model_info = built.module, built.info
            self._is_lora = built.is_lora
            if built.is_lora and self._is_rollout:
                from verl.workers.lora import check_lora_rollout_config

                check_lora_rollout_config(cfg)
            self.actor_optimizer, self.actor_lr_scheduler = build_optimizer_and_scheduler(self.actor_module, cfg.actor.optim)
            self.actor = DataParallelPPOActor(cfg.actor, self.actor_module, self.actor_optimizer,
                                              use_remove_padding=built.use_remove_padding,
                                              use_fused_kernels=built.use_fused_kernels, ulysses_sp_size=sp)
            from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

            self.checkpoint_manager = FSDPCheckpointManager(
                self.actor_module, self.actor_optimizer, self.actor_lr_scheduler,
                processing_class=self.processor or self.tokenizer, checkpoint_config=cfg.actor.get("checkpoint"))
        if self._is_ref:
            if self._is_actor and built.is_lora:
                # LoRA: the reference policy is the actor with its adapters disabled; no second base model.
                self.ref_module = None
            else:
                ref_built = shard_model(cfg.model, cfg.ref.fsdp_config, role="ref", ulysses_sp_size=sp, enable_gc=False)
                self.ref_module = ref_built.module
            ref_mod = self.ref_module if self.ref_module is not None else self.actor_module
            self.ref_policy = DataParallelPPOActor(cfg.ref, ref_mod, use_remove_padding=self.actor.use_remove_padding
                                                   if self._is_actor else ref_built.use_remove_padding,
                                                   use_fused_kernels=False, ulysses_sp_size=sp)
        if self._is_rollout:
            self._build_rollout()
        # Sampling draws from the global RNGs: seed them per data-parallel rank so runs repeat exactly (and
        # checkpoints restore them, so a resumed run continues the same stream). The ranks of one SP group hold
        # the same prompts and must sample the same responses.
        seed = int(cfg.rollout.get("seed", 42) or 0) + self.dp_rank
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        return True

    def _build_sp_group(self, world: int, sp: int):
        """The Ulysses group of this rank (None without SP): a (dp, sp) mesh, consecutive ranks sharing data.
        FSDP2 still shards over all ranks; its gradient average over dp*sp is corrected by the sp factor that
        ``gather_outputs_and_unpad`` applies in the backward."""
        if sp <= 1:
            return None
        if world % sp:
            raise ValueError(f"actor.ulysses_sequence_parallel_size={sp} must divide the world size {world}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu" if self.device == "cpu" else self.device, (world // sp, sp),
                                mesh_dim_names=("dp", "sp"))
        return mesh["sp"].get_group()

    def _sp(self):
        """Context in which the patched model runs sequence-parallel: the SP group is registered only around
        the actor's and reference's forwards, so a colocated critic (no SP) never sees it."""
        return _UlyssesGroup(self.sp_group)

    def _normalize_batch_sizes(self):
        """Turn global batch sizes (in prompts) into per-rank sizes (in responses), as upstream does."""
        cfg = self.config
        n = cfg.rollout.n
        with open_dict(cfg):
            if self._is_actor:
                a = cfg.actor
                a.ppo_mini_batch_size = _per_rank(a.ppo_mini_batch_size * n, self.dp_size, "actor.ppo_mini_batch_size*rollout.n")
                if a.get("ppo_micro_batch_size") and not a.get("ppo_micro_batch_size_per_gpu"):
                    a.ppo_micro_batch_size_per_gpu = _per_rank(a.ppo_micro_batch_size, self.dp_size, "ppo_micro_batch_size")
            for sec in ("rollout", "ref"):
                s = cfg[sec]
                if s.get("log_prob_micro_batch_size") and not s.get("log_prob_micro_batch_size_per_gpu"):
                    s.log_prob_micro_batch_size_per_gpu = _per_rank(s.log_prob_micro_batch_size, self.dp_size,
                                                                    f"{sec}.log_prob_micro_batch_size")

    def _build_rollout(self):
        from verl.workers.rollout.base import get_rollout_class

        rcfg = self.config.rollout
        cls = get_rollout_class(rcfg.name)
        self.rollout = cls(config=rcfg, model_config=self.config.model, tokenizer=self.tokenizer,
                           module=self.actor_module if rcfg.name == "hf" else None, processor=self.processor)
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(getattr(self.actor_module, "generation_config", None), "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else ([gen_eos] if gen_eos is not None else []))
        self.eos_ids = sorted(ids)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.agent_loop = None
        if rcfg.get("multi_turn", {}).get("enable", False):
            from verl.experimental.agent_loop import AgentLoopManager

            self.agent_loop = AgentLoopManager(self.full_config, self.rollout, self.tokenizer, self.processor,
                                               model_config=self.actor_module.config)
        from verl.workers.weight_sync.cycle import RolloutCycle

        # Sleep after generating, wake weights -> sync -> wake KV cache before generating (free_cache_engine).
        self.rollout_cycle = RolloutCycle(self.rollout, self._sync_rollout_weights if rcfg.name != "hf" else _no_sync)

    def _sync_rollout_weights(self):
        from verl.workers.weight_sync import iter_hf_weights

        bucket = int(self.config.rollout.get("checkpoint_engine", {}).get("update_weights_bucket_megabytes", 512))
        if getattr(self, "_is_lora", False):
            from verl.workers.lora import rollout_sync

            # adapter tensors, or merged weights where the engine cannot take the adapter (logged)
            weights, kw = rollout_sync(self.actor_module, bucket_megabytes=bucket,
                                       layered=bool(self.config.rollout.get("layered_summon", False)))
            self.rollout.update_weights(weights, **kw)
            return
        weights = iter_hf_weights(self.actor_module, bucket_megabytes=bucket,
                                  layered=bool(self.config.rollout.get("layered_summon", False)))
        self.rollout.update_weights(weights)

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        from verl.workers.rollout.batching import generate_sequences

        t0 = time.time()
        prompts.meta_info.setdefault("response_length", self.config.rollout.response_length)
        self.rollout_cycle.before_generate()
        try:
            if self.agent_loop is not None:
                out = self.agent_loop.generate_sequences(prompts)
            else:
                out = generate_sequences(self.rollout, prompts, self.config.rollout, self.eos_ids, self.pad_token_id)
        finally:
            self.rollout_cycle.after_generate()
        # Numbers that differ between data-parallel ranks go in meta_info["metrics"] as one dict per rank:
        # DataProto.concat merges that key into lists, and rejects any other key whose values differ.
        rank_metrics = dict(out.meta_info.pop("agent_loop_metrics", None) or {})
        out.meta_info.pop("metrics", None)  # per-sample agent-loop metrics; aggregated in agent_loop_metrics
        rank_metrics["timing_s/generate_sequences"] = time.time() - t0
        out.meta_info["metrics"] = [rank_metrics]
        return out

    # ------------------------------------------------------------------ log-probs
    def _log_prob_meta(self, data: DataProto, section: str) -> None:
        s = self.config[section]
        data.meta_info.setdefault("micro_batch_size", s.get("log_prob_micro_batch_size_per_gpu") or 8)
        data.meta_info.setdefault("use_dynamic_bsz", bool(s.get("log_prob_use_dynamic_bsz", False)))
        data.meta_info.setdefault("max_token_len", s.get("log_prob_max_token_len_per_gpu") or 16384)
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        self._log_prob_meta(data, "rollout")
        calc_entropy = bool(data.meta_info.get("calculate_entropy", True))
        with self._sp():
            log_probs, entropys = self.actor.compute_log_prob(data, calculate_entropy=calc_entropy)
        tensors = {"old_log_probs": log_probs}
        if entropys is not None:
            tensors["entropys"] = entropys
        return DataProto.from_dict(tensors=tensors, meta_info={"temperature": data.meta_info["temperature"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        self._log_prob_meta(data, "ref")
        with self._sp():
            if self.ref_module is None:
                with self.actor_module.disable_adapter():
                    log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
            else:
                log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    # ------------------------------------------------------------------ update
    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict:
        t0 = time.time()
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        with self._sp():
            metrics = self.actor.update_policy(data)
        lr = self.actor_lr_scheduler.get_last_lr()[0]
        self.actor_lr_scheduler.step()
        metrics["actor/lr"] = lr
        if self._is_rollout:
            self.rollout_cycle.weights_changed()
        metrics["perf/update_actor_s"] = time.time() - t0
        return metrics

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep=None):
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        self.checkpoint_manager.load_checkpoint(local_path)
        if self._is_rollout:
            self.rollout_cycle.weights_changed()
        return True


def _no_sync():
    """The hf engine generates with the actor module itself: nothing to sync."""


class _UlyssesGroup:
    """Registers ``group`` as the Ulysses SP group for the duration of a ``with`` block (no-op for None)."""

    def __init__(self, group):
        self.group, self.prev = group, None

    def __enter__(self):
        from verl.utils import ulysses

        self.prev = ulysses.get_ulysses_sequence_parallel_group()
        if self.group is not None:
            ulysses.set_ulysses_sequence_parallel_group(self.group)
        return self

    def __exit__(self, *exc):
        from verl.utils import ulysses

        ulysses.set_ulysses_sequence_parallel_group(self.prev)
        return False


class CriticWorker(Worker):
    """A value model (the actor's backbone plus a scalar head) trained with the clipped value loss."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.workers.critic.dp_critic import DataParallelPPOCritic

        self.ensure_process_group()
        cfg = self.config
        dp = dist.get_world_size()
        with open_dict(cfg):
            cfg.ppo_mini_batch_size = _per_rank(cfg.ppo_mini_batch_size * cfg.get("rollout_n", 1), dp,
                                                "critic.ppo_mini_batch_size*rollout.n")
            if cfg.get("ppo_micro_batch_size") and not cfg.get("ppo_micro_batch_size_per_gpu"):
                cfg.ppo_micro_batch_size_per_gpu = _per_rank(cfg.ppo_micro_batch_size, dp, "critic.ppo_micro_batch_size")
        self.tokenizer, _ = load_tokenizer_and_processor(cfg.model)
        built = shard_model(cfg.model, cfg.get("fsdp") or cfg.model.get("fsdp_config") or {},
                            role="critic", enable_gc=cfg.model.get("enable_gradient_checkpointing", False))
        self.critic_module = built.module
        self.critic_optimizer, self.critic_lr_scheduler = build_optimizer_and_scheduler(self.critic_module, cfg.optim)
        self.critic = DataParallelPPOCritic(cfg, self.critic_module, self.critic_optimizer)
        self.checkpoint_manager = FSDPCheckpointManager(self.critic_module, self.critic_optimizer,
                                                        self.critic_lr_scheduler, processing_class=self.tokenizer,
                                                        checkpoint_config=cfg.get("checkpoint"))
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"values": self.critic.compute_values(data)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto) -> dict:
        metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_lr_scheduler.get_last_lr()[0]
        self.critic_lr_scheduler.step()
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep=None):
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        self.checkpoint_manager.load_checkpoint(local_path)
        return True
