"""Engine-based workers: the hybrid actor + rollout + reference worker, and the critic worker.

One process per device hosts these roles (colocated); the controller calls the methods marked with
``register`` through a worker group, which splits DataProto batches by data-parallel rank. Each role runs on
a training engine picked by its section's ``strategy`` from :data:`verl.workers.engine.EngineRegistry`
(``fsdp2``, alias ``fsdp``; ``megatron``), so no worker code depends on the backend.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.profiler_worker import profiled_task
from verl.single_controller.worker import Worker
from verl.utils.device import get_device_name, get_torch_device, resolve_trainer_device
from verl.utils.tokenizer import load_tokenizer_and_processor
from verl.workers.engine import EngineRegistry
from verl.workers.engine.sections import engine_section, ranks_per_dp_replica, role_dp_layout  # noqa: F401


def _per_rank(total: int, world: int, name: str) -> int:
    if total % world != 0:
        raise ValueError(f"{name}={total} must be divisible by the data-parallel size {world}")
    return total // world


def update_mfu(counter, data: DataProto, seconds: float, passes: int) -> float:
    """``perf/mfu/*`` of one update, as upstream defines it: training FLOPs of the whole batch (every rank's
    tokens, ``meta_info["global_token_num"]``) times the passes over it (``ppo_epochs``), over the seconds taken
    and the peak FLOP/s of all ranks. 0 where the device's peak is unknown (the CPU reads a nominal peak)."""
    tokens = data.meta_info.get("global_token_num")
    if counter is None or not tokens or seconds <= 0:
        return 0.0
    achieved, peak = counter.estimate_flops(tokens, seconds)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return achieved * passes / peak / world


def flops_counter_for(engine):
    """A FlopsCounter for ``engine``'s model (it warns once where the model spec names no FLOPs formula)."""
    from verl.utils.flops_counter import FlopsCounter

    config = engine.model_hf_config()
    return None if config is None else FlopsCounter(config)


def build_engine(role_cfg: DictConfig, model_cfg: DictConfig, role: str, trainable: bool, **kwargs):
    """Construct (not yet initialize) the engine of ``role`` from its section's ``strategy``; the whole role
    section goes along as ``role_config`` for keys upstream keeps there."""
    strategy = str(role_cfg.get("strategy") or "fsdp2")
    cls = EngineRegistry.get_or_raise(strategy)
    return cls(model_cfg, engine_section(role_cfg, strategy), role_cfg.get("optim") if trainable else None,
               role_cfg.get("checkpoint") if trainable else None, role=role, role_config=role_cfg, strategy=strategy,
               **kwargs)


def _generation_config(model_cfg):
    """The checkpoint's generation config (its EOS ids), read from the files where no module is loaded; None
    where the checkpoint has none (the tokenizer's EOS stands alone then, as with a module built without one)."""
    from transformers import GenerationConfig

    from verl.utils.model_path import model_config_dir

    try:
        return GenerationConfig.from_pretrained(model_config_dir(model_cfg))
    except OSError:
        return None


def _rng_state() -> dict:
    device = get_torch_device()
    on_device = get_device_name() != "cpu" and device.is_available()
    return {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate(),
            "device": device.get_rng_state() if on_device else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if state.get("device") is not None:
        get_torch_device().set_rng_state(state["device"])


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
        requested = OmegaConf.select(self.full_config, "trainer.device", default=None)
        # trainer.device is honoured as far as the host allows; a mismatch is announced (once, by rank 0).
        self.device = resolve_trainer_device(requested) if requested and self.rank == 0 else get_device_name()

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.workers.actor.ppo_actor import PPOActor

        self.ensure_process_group()
        cfg = self.config
        world = dist.get_world_size()
        sp = int(cfg.actor.get("ulysses_sequence_parallel_size", 1))
        # The same table the controller dispatches by (main_ppo.role_dp_layouts): which replica's chunk this
        # rank receives; Megatron's replicas are not consecutive ranks.
        self._dp_layout = role_dp_layout(cfg.actor, world)
        self.dp_size = self._dp_layout.dp_size
        self.dp_rank = self._dp_layout.replica_of[self.rank]
        self.tokenizer, self.processor = load_tokenizer_and_processor(cfg.model)
        self._normalize_batch_sizes()
        self._is_lora = False
        self.actor_engine = None
        if self._is_actor:
            self.actor_engine = build_engine(cfg.actor, cfg.model, "actor", trainable=True,
                                             processing_class=self.processor or self.tokenizer)
            self.actor_engine.initialize()
            self._is_lora = bool(getattr(self.actor_engine, "is_lora", False))
            if self._is_lora and self._is_rollout:
                from verl.workers.lora import check_lora_rollout_config

                check_lora_rollout_config(cfg)
            self.actor = PPOActor(cfg.actor, self.actor_engine, distillation=self._distillation_section())
            self.actor_flops = flops_counter_for(self.actor_engine)
        if self._is_ref:
            # LoRA: the reference policy is the actor with its adapters disabled; no second base model.
            share = {"share_module_with": self.actor_engine} if self._is_lora else {}
            if self._is_lora:  # the shared module was patched for the actor's sequence-parallel layout
                with open_dict(cfg.ref):
                    cfg.ref.ulysses_sequence_parallel_size = sp
            self.ref_engine = build_engine(cfg.ref, cfg.model, "ref", trainable=False, **share)
            self.ref_engine.initialize()
            self.ref_policy = PPOActor(cfg.ref, self.ref_engine)
        self.teacher_engine = None
        if self._is_actor and self._distillation_section() is not None:
            self._build_teacher()
        if self._is_rollout and not self._is_actor:
            # A rollout pool of its own (asynchronous modes), synced from the trainer pool by
            # load_rollout_weights; weight_version counts those syncs. An engine that generates with a training
            # module (hf) gets a policy copy to generate with; one that holds its own weights (vLLM) needs none.
            from verl.workers.rollout.base import get_rollout_class

            if getattr(get_rollout_class(cfg.rollout.name), "generates_with_training_module", False):
                self.actor_engine = build_engine(cfg.actor, cfg.model, "rollout", trainable=False)
                self.actor_engine.initialize()
            self.weight_version = 0
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

    def _distillation_section(self):
        """The ``distillation`` section when distillation is enabled, else None."""
        from verl.trainer.distillation import is_distillation_enabled

        section = self.full_config.get("distillation")
        return section if is_distillation_enabled(section) else None

    def _build_teacher(self):
        """The distillation teacher, colocated with the actor: a frozen engine like the reference's (the ref
        section's strategy and engine settings) on the teacher checkpoint. The teacher reads the student's token
        ids, so it must share the student's tokenizer; the student's model options (remove-padding, fused
        kernels, override_config) apply to it too, its LoRA settings do not."""
        from verl.trainer.distillation import teacher_model_config
        from verl.workers.actor.ppo_actor import PPOActor

        teacher = teacher_model_config(self.full_config.distillation)
        model_cfg = OmegaConf.create(OmegaConf.to_container(self.config.model, resolve=True))
        with open_dict(model_cfg):
            model_cfg.path = str(teacher.model_path)
            model_cfg.tokenizer_path = self.config.model.get("tokenizer_path") or self.config.model.path
            model_cfg.lora_rank = 0
            model_cfg.lora_adapter_path = None
        self.teacher_engine = build_engine(self.config.ref, model_cfg, "teacher", trainable=False)
        self.teacher_engine.initialize()
        self.teacher_policy = PPOActor(self.config.ref, self.teacher_engine)

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
        # A registered rollout may be a factory function or a duck-typed class: only those that say so share the
        # actor's module (BaseRollout.generates_with_training_module).
        shares_module = bool(getattr(cls, "generates_with_training_module", False))
        module = None  # a rollout pool's vLLM engine has no training module beside it
        if self.actor_engine is not None:
            module = self.actor_engine.hf_rollout_module() if shares_module else self.actor_engine.module
        self.rollout = cls(config=rcfg, model_config=self.config.model, tokenizer=self.tokenizer,
                           module=module if shares_module else None, processor=self.processor)
        eos = self.tokenizer.eos_token_id
        generation_config = getattr(module, "generation_config", None) if module is not None else \
            _generation_config(self.config.model)
        gen_eos = getattr(generation_config, "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else ([gen_eos] if gen_eos is not None else []))
        self.eos_ids = sorted(ids)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.agent_loop = None
        if rcfg.get("multi_turn", {}).get("enable", False):
            from verl.experimental.agent_loop import AgentLoopManager

            self.agent_loop = AgentLoopManager(self.full_config, self.rollout, self.tokenizer, self.processor,
                                               model_config=module.config)
        from verl.workers.sp_regroup import consecutive_group
        from verl.workers.weight_sync.cycle import RolloutCycle

        # An engine shared by consecutive ranks (vLLM TP under the external launcher) needs one batch on all of
        # them, whatever replica each rank serves for the actor (Megatron's ranks are pipeline-outermost).
        self._rollout_group = consecutive_group(int(getattr(self.rollout, "spmd_ranks", 1) or 1))
        # Sleep after generating, wake weights -> sync -> wake KV cache before generating (free_cache_engine). A
        # rollout pool of its own shares its devices with no trainer and gets weights only by
        # load_rollout_weights: its engine stays awake.
        release = None
        if shares_module and self.actor_engine is not None and rcfg.get("free_cache_engine", True):
            release = self.actor_engine.release_hf_rollout_module  # an hf copy of its own (Megatron): freed
        self.rollout_cycle = RolloutCycle(self.rollout, self._sync_rollout_weights,
                                          dedicated=self._is_rollout and not self._is_actor, release=release)

    def _sync_rollout_weights(self):
        """Weights from the actor engine's parameter generator (adapter-only for LoRA where the rollout can
        apply it) into the rollout engine."""
        if getattr(self.rollout, "generates_with_training_module", False):
            self.actor_engine.sync_hf_rollout_module()  # no-op where hf generates with the training module
            return
        bucket = int(self.config.rollout.get("checkpoint_engine", {}).get("update_weights_bucket_megabytes", 512))
        weights, kwargs = self.actor_engine.get_rollout_weights(
            bucket_megabytes=bucket, layered=bool(self.config.rollout.get("layered_summon", False)))
        self.rollout.update_weights(weights, **kwargs)

    # ------------------------------------------------------------------ separate pools (asynchronous modes)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_rollout_weights(self):
        """The actor's full HF-named weights as a :class:`~verl.workers.weight_sync.handoff.WeightPackage` (rank
        0's; the others return None). Every rank drives the gather, which is collective."""
        bucket = int(self.config.rollout.get("checkpoint_engine", {}).get("update_weights_bucket_megabytes", 512))
        weights, kwargs = self.actor_engine.get_rollout_weights(bucket_megabytes=bucket)
        if kwargs:  # a LoRA adapter alone: the rollout pool's copy holds no adapter to apply it to
            raise ValueError("the asynchronous modes sync full weights; a LoRA actor's adapter-only sync is not "
                             "supported there (set actor_rollout_ref.model.lora_rank=0)")
        if self.rank != 0:
            for _ in weights:  # every rank drives the (collective) gather; rank 0 keeps the result
                pass
            return None
        from verl.workers.weight_sync.handoff import pack

        # One copy into Ray's object store, by this process; the controller forwards a small handle (handoff.py).
        return pack(weights)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, weights, version: int, in_flight: bool = False) -> int:
        """Install the trainer pool's weights (``export_rollout_weights``) as parameter version ``version``.
        ``in_flight`` (``async_training.partial_rollout``): chunks may be in flight; their decode session pauses
        between decode steps, the weights are copied into the same parameter storage (the session's captured CUDA
        graphs stay valid), and the unfinished responses go on with them."""
        if self._is_actor:
            raise RuntimeError("load_rollout_weights is for a rollout pool of its own (role 'rollout')")
        from verl.utils.device import get_device_id, get_device_name, is_device_available
        from verl.workers.weight_sync.handoff import unpack
        from verl.workers.weight_sync.receive import load_hf_weights

        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None and pipeline.pending() and not in_flight:
            raise RuntimeError(f"new weights while {pipeline.pending()} generation chunks are in flight: a "
                               "chunk must be generated with one weight version (collect them first)")

        device = f"{get_device_name()}:{get_device_id()}" if is_device_available() else "cpu"

        def install():
            received = unpack(weights, device)  # tensor by tensor, straight onto this rank's device
            if self.actor_engine is None:  # an engine holding its own weights (vLLM): its reload
                self.rollout.update_weights(received)
                return
            load_hf_weights(self.actor_engine.module, received)
            self.actor_engine.sync_hf_rollout_module()

        if pipeline is not None:
            pipeline.swap_weights(install, int(version))
        else:
            install()
        self.weight_version = int(version)
        return self.weight_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_pipelining(self) -> bool:
        """Whether this rank can keep several chunks in flight (:mod:`verl.workers.rollout.pipelined`)."""
        from verl.workers.rollout.pipelined import supports_pipelining

        return supports_pipelining(self.rollout, self.agent_loop, self._rollout_group)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def submit_generation(self, prompts: DataProto, tag: int, depth: int) -> None:
        """Start generating this rank's part of chunk ``tag`` and return at once; ``depth``: how many chunks the
        caller keeps in flight (sizes the slot cache). The chunk is generated with the weights held now."""
        if getattr(self, "_pipeline", None) is None:
            self._pipeline = self.rollout.chunk_pipeline_class(self.rollout, self.config.rollout, self.eos_ids,
                                                               self.pad_token_id)
            self._pipeline_started = {}
        prompts.meta_info.setdefault("response_length", self.config.rollout.response_length)
        if not self._pipeline.pending():
            self.rollout_cycle.before_generate()
        self._pipeline.submit(tag, prompts, int(depth), self.weight_version)
        self._pipeline_started[tag] = time.time()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generation_ready(self, tag: int, timeout: float = 0.0) -> bool:
        """Whether this rank's part of chunk ``tag`` is done (waiting up to ``timeout`` seconds): the rollouter
        polls with it so that it never blocks in a collect while weights wait to go in (partial rollout)."""
        return self._pipeline.ready(tag, float(timeout))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def collect_generation(self, tag: int) -> DataProto:
        """Chunk ``tag`` (blocking), laid out as :meth:`generate_sequences` returns it, each response token
        stamped with the weight version it was sampled with (``rollout_weight_version``; with partial rollout a
        response may span versions)."""
        t0 = self._pipeline_started.pop(tag)
        try:
            out = self._pipeline.collect(tag)
        finally:
            if not self._pipeline.pending():
                self.rollout_cycle.after_generate()
        rank_metrics = {"timing_s/generate_sequences": time.time() - t0}
        rank_metrics.update(getattr(self.rollout, "engine_metrics", None) or {})
        out.meta_info["metrics"] = [rank_metrics]
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_rng_state(self) -> dict:
        """This rank's sampling RNG state: a rollout pool's checkpoint part (the trainer keeps the state after
        the last chunk it consumed, so a resumed run samples as if the dropped queue had never been drawn)."""
        return _rng_state()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def set_rollout_rng_state(self, state: dict) -> bool:
        _set_rng_state(state)
        return True

    def _stamp_weight_version(self, out: DataProto) -> None:
        """Per-token record of the parameter version that generated each response token (0 on padding): the one
        held now (a pipelined chunk stamps its own, token by token: :mod:`verl.workers.rollout.pipelined`)."""
        if not hasattr(self, "weight_version") or "responses" not in out.batch.keys():
            return
        mask = out.batch["attention_mask"][:, -out.batch["responses"].size(1):]
        out.batch["rollout_weight_version"] = mask.long() * self.weight_version

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled_task("rollout", "rollout_generate")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        from verl.workers.rollout.batching import generate_sequences
        from verl.workers.sp_regroup import compute_in_group

        t0 = time.time()
        prompts.meta_info.setdefault("response_length", self.config.rollout.response_length)
        self.rollout_cycle.before_generate()
        def run(batch: DataProto) -> DataProto:
            if self.agent_loop is not None:
                return self.agent_loop.generate_sequences(batch)
            return generate_sequences(self.rollout, batch, self.config.rollout, self.eos_ids, self.pad_token_id)

        try:
            out = compute_in_group(prompts, self._rollout_group, self._dp_layout, run)
        finally:
            self.rollout_cycle.after_generate()
        self._stamp_weight_version(out)
        # Numbers that differ between data-parallel ranks go in meta_info["metrics"] as one dict per rank:
        # DataProto.concat merges that key into lists, and rejects any other key whose values differ.
        rank_metrics = dict(out.meta_info.pop("agent_loop_metrics", None) or {})
        out.meta_info.pop("metrics", None)  # per-sample agent-loop metrics; aggregated in agent_loop_metrics
        rank_metrics["timing_s/generate_sequences"] = time.time() - t0
        # the weight sync ran at the start of this call: the trainer reports it as its own phase (upstream's)
        rank_metrics["timing_s/update_weights"] = self.rollout_cycle.last_sync_s
        rank_metrics.update(getattr(self.rollout, "memory_metrics", None) or {})  # device memory around sleep
        rank_metrics.update(getattr(self.rollout, "engine_metrics", None) or {})  # the hf decode loop's split
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
    @profiled_task("actor", "actor_compute_log_prob")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        self._log_prob_meta(data, "rollout")
        calc_entropy = bool(data.meta_info.get("calculate_entropy", True))
        record = self.actor.router_replay_mode == "R2"  # R2 records here and replays in the update
        if record and "routed_experts" in data.batch.keys():
            raise ValueError("router_replay.mode=R2 and actor_rollout_ref.rollout.enable_rollout_routing_replay=true "
                             "cannot both be on: the rollout's routes are for R3")
        sum_pi2 = bool(self.config.actor.get("calculate_sum_pi_squared", False))  # the optimal token baseline's
        result = self.actor.compute_log_prob(data, calculate_entropy=calc_entropy, record_routes=record,
                                             calculate_sum_pi_squared=sum_pi2)
        log_probs, entropys = result[0], result[1]
        tensors = {"old_log_probs": log_probs}
        if entropys is not None:
            tensors["entropys"] = entropys
        if record:
            tensors["routed_experts"] = result[2]
        if sum_pi2:
            tensors["sum_pi_squared"] = result[-1]
        return DataProto.from_dict(tensors=tensors, meta_info={"temperature": data.meta_info["temperature"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled_task("ref", "ref_compute_log_prob")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        from verl.workers.sp_regroup import compute_in_group

        self._log_prob_meta(data, "ref")

        def ref_log_prob(batch: DataProto) -> DataProto:
            log_probs, _ = self.ref_policy.compute_log_prob(batch, calculate_entropy=False)
            return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

        # ref.ulysses_sequence_parallel_size may differ from the actor's, whose layout the data arrives in
        return compute_in_group(data, getattr(self.ref_engine, "sp_group", None), self._dp_layout, ref_log_prob)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """The distillation teacher's log-probs of the sampled response tokens (``teacher_logprobs``, (B, R)),
        micro-batched and packed like the reference's (the ref section's log_prob_* keys). The teacher scores
        at temperature 1 whatever the rollout's, as upstream's teacher does (a forward pass, no sampling)."""
        from verl.workers.sp_regroup import compute_in_group

        if self.teacher_engine is None:
            raise RuntimeError("compute_teacher_log_prob needs distillation.enabled=true on the actor's worker")
        self._log_prob_meta(data, "ref")
        data.meta_info["temperature"] = 1.0

        def teacher_log_prob(batch: DataProto) -> DataProto:
            log_probs, _ = self.teacher_policy.compute_log_prob(batch, calculate_entropy=False)
            return DataProto.from_dict(tensors={"teacher_logprobs": log_probs})

        return compute_in_group(data, getattr(self.teacher_engine, "sp_group", None), self._dp_layout,
                                teacher_log_prob)

    # ------------------------------------------------------------------ update
    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @profiled_task("actor", "actor_update")
    def update_actor(self, data: DataProto) -> dict:
        t0 = time.time()
        device = get_torch_device()
        device.reset_peak_memory_stats()  # the peaks below are this update's
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        metrics = self.actor.update_policy(data)
        metrics["actor/lr"] = self.actor_engine.lr_scheduler_step()
        if self._is_rollout:
            self.rollout_cycle.weights_changed()
        seconds = time.time() - t0
        metrics["perf/update_actor_s"] = seconds
        metrics["perf/mfu/actor"] = update_mfu(self.actor_flops, data, seconds, int(self.config.actor.ppo_epochs))
        if get_device_name() != "cpu":  # upstream's names; the CPU shim has no allocator statistics
            metrics["perf/max_memory_allocated_gb"] = device.max_memory_allocated() / 2**30
            metrics["perf/max_memory_reserved_gb"] = device.max_memory_reserved() / 2**30
        return metrics

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep=None):
        self.actor_engine.save_checkpoint(local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        self.actor_engine.load_checkpoint(local_path)
        if self._is_rollout:
            self.rollout_cycle.weights_changed()
        return True


class CriticWorker(Worker):
    """A value model (the actor's backbone plus a scalar head) trained with the clipped value loss."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.workers.critic.ppo_critic import PPOCritic

        self.ensure_process_group()
        cfg = self.config
        dp = role_dp_layout(cfg, dist.get_world_size()).dp_size
        with open_dict(cfg):
            cfg.ppo_mini_batch_size = _per_rank(cfg.ppo_mini_batch_size * cfg.get("rollout_n", 1), dp,
                                                "critic.ppo_mini_batch_size*rollout.n")
            if cfg.get("ppo_micro_batch_size") and not cfg.get("ppo_micro_batch_size_per_gpu"):
                cfg.ppo_micro_batch_size_per_gpu = _per_rank(cfg.ppo_micro_batch_size, dp, "critic.ppo_micro_batch_size")
        self.tokenizer, _ = load_tokenizer_and_processor(cfg.model, section="critic.model")
        self.critic_engine = build_engine(cfg, cfg.model, "critic", trainable=True, processing_class=self.tokenizer)
        self.critic_engine.initialize()
        self.critic = PPOCritic(cfg, self.critic_engine)
        self.critic_flops = flops_counter_for(self.critic_engine)
        return True

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled_task("critic", "critic_compute_values")
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"values": self.critic.compute_values(data)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @profiled_task("critic", "critic_update")
    def update_critic(self, data: DataProto) -> dict:
        t0 = time.time()
        metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_engine.lr_scheduler_step()
        metrics["perf/mfu/critic"] = update_mfu(self.critic_flops, data, time.time() - t0, int(self.config.ppo_epochs))
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep=None):
        self.critic_engine.save_checkpoint(local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False):
        self.critic_engine.load_checkpoint(local_path)
        return True
