"""The PPO/GRPO step loop on the controller.

Per step, in upstream verl's order: generate -> reward -> old log-prob -> ref log-prob -> teacher log-prob
(distillation) -> values ->
advantage -> critic update -> actor update (which also syncs rollout weights) -> checkpoint ->
validation -> logging. The controller only moves DataProto batches between worker groups; it never
touches model weights.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.trainer import faults
from verl.trainer.config.validate import need_critic, need_reference_policy
from verl.trainer.distillation import is_distillation_enabled
from verl.trainer.ppo import core_algos, filter_groups, rollout_corr
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.dataloader import StepDataLoader
from verl.trainer.ppo.kl import apply_kl_penalty
from verl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    flatten_validation_metrics,
    fold_save_into_step,
    process_validation_metrics,
    reduce_metrics,
)
from verl.trainer.ppo.remax import greedy_reward_baselines
from verl.trainer.ppo.reward import compute_reward
from verl.utils.checkpoint import step_dirs as ckpt_dirs
from verl.utils.checkpoint.step_dirs import LATEST_FILE  # noqa: F401 (its public name here)
from verl.utils.profiler import StepProfiler

logger = logging.getLogger(__name__)



@contextmanager
def marked_timer(name: str, timing: dict):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


def compute_response_mask(data: DataProto) -> torch.Tensor:
    response_length = data.batch["responses"].size(1)
    return data.batch["attention_mask"][:, -response_length:]


_TOKEN_BASELINES = (AdvantageEstimator.OPTIMAL_TOKEN_BASELINE.value,
                    AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE.value)


def compute_advantage(data: DataProto, adv_estimator, gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                      norm_adv_by_std_in_grpo: bool = True, config=None) -> DataProto:
    """Fill ``advantages`` and ``returns`` using the configured estimator."""
    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = compute_response_mask(data)
    name = adv_estimator.value if isinstance(adv_estimator, AdvantageEstimator) else str(adv_estimator)
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    if name == AdvantageEstimator.GAE.value:
        adv, ret = core_algos.compute_gae_advantage_return(token_level_rewards=rewards, values=data.batch["values"],
                                                           response_mask=mask, gamma=gamma, lam=lam)
    else:
        fn = core_algos.get_adv_estimator_fn(name)
        kwargs = {"token_level_rewards": rewards, "response_mask": mask, "config": config}
        if "uid" in data.non_tensor_batch:
            kwargs["index"] = data.non_tensor_batch["uid"]
        if name in (AdvantageEstimator.GRPO.value, AdvantageEstimator.GRPO_VECTORIZED.value):
            kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
        if "reward_baselines" in data.batch.keys():
            kwargs["reward_baselines"] = data.batch["reward_baselines"]
        if name in _TOKEN_BASELINES:  # the per-token baselines weigh by the actor's path-variance terms
            kwargs.update({k: data.batch[k] if k in data.batch.keys() else None
                           for k in ("old_log_probs", "sum_pi_squared", "rollout_is_weights")})
        if "non_tensor_batch" in inspect.signature(fn).parameters:  # GDPO reads per-key rewards from the batch
            kwargs.update(non_tensor_batch=data.non_tensor_batch, batch=data.batch)
        adv, ret = fn(**kwargs)
    data.batch["advantages"] = adv
    data.batch["returns"] = ret
    return data


class RayPPOTrainer:
    """Drives worker groups through PPO steps. ``worker_groups`` maps role -> worker group."""

    def __init__(self, config, tokenizer, worker_groups: dict, train_dataset, val_dataset, collate_fn,
                 reward_fn, val_reward_fn, processor=None):
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.wgs = worker_groups
        self.actor_rollout_wg = worker_groups["actor_rollout"]
        # Who generates: the actor's own workers when colocated; a separate pool's in the asynchronous modes.
        self.rollout_wg = worker_groups.get("rollout", self.actor_rollout_wg)
        self.critic_wg = worker_groups.get("critic")
        self.rm_wg = worker_groups.get("reward_model")  # reward.reward_model.enable: a discriminative reward model
        # A generative reward model's router (verl.trainer.ppo.genrm): set by run_ppo; its counters are logged.
        self.genrm_router = None
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.collate_fn = collate_fn
        algo = config.algorithm
        self.use_critic = need_critic(config)
        self.use_reference_policy = need_reference_policy(config)
        self.use_distillation = is_distillation_enabled(config.get("distillation"))
        self.kl_ctrl_in_reward = core_algos.get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        data = config.data
        # data.gen_batch_size prompts per generation (DAPO draws several when filtering); else one train batch.
        self.train_dataloader = StepDataLoader(train_dataset, batch_size=data.get("gen_batch_size") or
                                               data.train_batch_size, collate_fn=collate_fn,
                                               shuffle=data.get("shuffle", True), seed=data.get("seed", 1) or 1)
        val_bs = data.get("val_batch_size") or len(val_dataset) if val_dataset is not None else 0
        self.val_dataloader = (StepDataLoader(val_dataset, batch_size=val_bs, collate_fn=collate_fn, shuffle=False,
                                              drop_last=False) if val_dataset is not None else None)
        self.total_training_steps = self._total_steps()
        self.global_steps = 0
        self.world_size = self.actor_rollout_wg.world_size
        self.profiler = StepProfiler(config, worker_groups)  # global_profiler.*: torch traces of chosen steps
        self._batches = None  # the prompt-batch stream fit() draws from (DAPO draws extra batches from it)

    def _total_steps(self) -> int:
        per_epoch = len(self.train_dataloader)
        if per_epoch == 0:
            raise ValueError(f"the training set has {len(self.train_dataset)} rows, fewer than data.train_batch_size="
                             f"{self.config.data.train_batch_size}; lower the batch size or add data")
        total = per_epoch * self.config.trainer.total_epochs
        if self.config.trainer.get("total_training_steps"):
            total = int(self.config.trainer.total_training_steps)
        return total

    # ------------------------------------------------------------------ helpers
    def _dp_size(self, method) -> int:
        """Data-parallel size of the worker group ``method`` belongs to (its layout's number of replicas)."""
        return getattr(getattr(method, "worker_group", None), "dp_size", None) or self.world_size

    def _dp_call(self, method, data: DataProto) -> DataProto:
        """Call a DP_COMPUTE_PROTO method with the batch padded to a multiple of its data-parallel size."""
        padded, pad = pad_dataproto_to_divisor(data, self._dp_size(method))
        out = method(padded)
        return unpad_dataproto(out, pad)

    @staticmethod
    def _gen_batch(batch: DataProto) -> DataProto:
        """The part of a training batch the rollout needs; everything else stays on the controller."""
        keep = [k for k in ("raw_prompt_ids", "multi_modal_data", "multi_modal_inputs", "raw_prompt", "tools_kwargs",
                            "interaction_kwargs", "agent_name", "index", "uid") if k in batch.non_tensor_batch]
        return batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_batch_keys=keep,
                            deepcopy=False)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> str:
        return ckpt_dirs.checkpoint_root(self.config.trainer.default_local_dir)

    def _save_checkpoint(self) -> str:
        """Write step ``global_steps`` (every role, the data position, the manifest), then mark it latest.

        A failure on the way (a full disk, a write error, a worker dying mid-save) leaves the previous checkpoint
        marked and intact: the partial directory is removed and the run stops with a checkpoint error."""
        root = self._ckpt_root()
        step_dir = ckpt_dirs.step_dir(root, self.global_steps)
        try:
            self.actor_rollout_wg.save_checkpoint(os.path.join(step_dir, "actor"), global_step=self.global_steps)
            if self.use_critic:
                self.critic_wg.save_checkpoint(os.path.join(step_dir, "critic"), global_step=self.global_steps)
            ckpt_dirs.atomic_torch_save(self._data_state(), os.path.join(step_dir, "data.pt"))
            ckpt_dirs.write_manifest(step_dir)
        except faults.WorkerDied:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to write leaves the old checkpoint in charge
            raise ckpt_dirs.save_failed(root, step_dir, err) from err
        # Mark the step as latest only once every part is on disk; a crash before this keeps the old mark.
        ckpt_dirs.mark_latest(root, self.global_steps)
        ckpt_dirs.prune_steps(root, self.config.trainer.get("max_actor_ckpt_to_keep"))
        return step_dir

    def _find_resume_dir(self) -> Optional[str]:
        return ckpt_dirs.resume_dir(self.config.trainer)

    def _load_checkpoint(self) -> None:
        step_dir = self._find_resume_dir()
        if step_dir is None:
            return
        # A missing, truncated or partial checkpoint is refused, naming the file, before any worker loads it.
        ckpt_dirs.check_resumable(step_dir)
        self.global_steps = ckpt_dirs.step_of(step_dir)
        print(f"Resuming from {step_dir} (global step {self.global_steps})", flush=True)
        with ckpt_dirs.loading(step_dir):
            self.actor_rollout_wg.load_checkpoint(os.path.join(step_dir, "actor"))
            if self.use_critic:
                self.critic_wg.load_checkpoint(os.path.join(step_dir, "critic"))
            data_file = os.path.join(step_dir, "data.pt")
            if os.path.exists(data_file):
                self._load_data_state(ckpt_dirs.torch_load(data_file))

    def _data_state(self) -> dict:
        """What ``data.pt`` holds: the controller's part of a checkpoint (the workers save their own)."""
        return self.train_dataloader.state_dict()

    def _load_data_state(self, state: dict) -> None:
        self.train_dataloader.load_state_dict(state)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> dict[str, float]:
        if self.val_dataloader is None or self.val_reward_fn is None:
            return {}
        vk = self.config.actor_rollout_ref.rollout.val_kwargs
        sources, uids, scores = [], [], []
        extra: dict[str, list] = {}
        for batch_dict in self.val_dataloader.epoch_iter(0):
            batch = DataProto.from_single_dict(batch_dict)
            batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
            batch = batch.repeat(repeat_times=vk.n, interleave=True)
            gen = self._gen_batch(batch)
            gen.meta_info = {"validate": True, "do_sample": vk.do_sample, "global_steps": self.global_steps}
            out = self._dp_call(self.rollout_wg.generate_sequences, gen)
            out.meta_info = {}
            batch = self._merge_generation(batch, out)
            batch = self._rm_score(batch)
            reward, infos = compute_reward(batch, self.val_reward_fn)
            scores.extend(reward.sum(-1).tolist())
            for k, v in infos.items():
                extra.setdefault(k, []).extend(list(v))
            sources.extend(batch.non_tensor_batch.get("data_source", np.array(["unknown"] * len(batch))).tolist())
            uids.extend(batch.non_tensor_batch["uid"].tolist())
        infos = {"reward": scores, **{k: v for k, v in extra.items() if len(v) == len(scores)}}
        metrics = flatten_validation_metrics(process_validation_metrics(sources, uids, infos))
        if self.genrm_router is not None:
            from verl.trainer.ppo.genrm import verdict_metrics

            self.genrm_router.pop_metrics()  # the training steps' reward/genrm/* counters count their own requests
            metrics.update({f"val-aux/{k.removeprefix('reward/')}": v for k, v in verdict_metrics(extra).items()})
        return metrics

    def _rm_score(self, batch: DataProto) -> DataProto:
        """Adds ``rm_scores`` from the reward model (when enabled); the reward managers then return them as the
        token-level scores, as upstream's do when a batch already holds reward-model scores."""
        if self.rm_wg is None or "rm_scores" in batch.batch.keys():
            return batch
        return batch.union(self._dp_call(self.rm_wg.compute_rm_score, batch))

    @staticmethod
    def _merge_generation(batch: DataProto, gen_out: DataProto) -> DataProto:
        for k in ("input_ids", "attention_mask", "position_ids"):
            batch.batch.pop(k)
        return batch.union(gen_out)

    # ------------------------------------------------------------------ main loop
    def fit(self, tracker=None) -> dict[str, Any]:
        """Train to ``total_training_steps``. SIGTERM (a scheduler's preemption) finishes the current step, saves
        it and raises :class:`verl.trainer.faults.Preempted`; see ``docs/advance/faults.md`` for every fault."""
        with faults.PreemptionGuard() as guard:
            self._preemption = guard
            try:
                return self._fit(tracker)
            except faults.WorkerDied as err:
                if guard.requested is None:
                    raise
                # The signal reached the worker processes too (a process-group kill): nothing left to save with.
                latest = ckpt_dirs.latest_step_dir(self._ckpt_root())
                raise faults.Preempted(self.global_steps - 1, None, guard.requested, detail=(
                    f"the worker processes ended too, during step {self.global_steps} ({err.message}); no "
                    f"checkpoint of that step; the latest complete one is {latest or 'none'}")) from err

    def _fit(self, tracker=None) -> dict[str, Any]:
        cfg = self.config
        guard = self._preemption
        self._on_nonfinite = faults.check_nonfinite_mode(str(cfg.trainer.get("on_nonfinite", "skip")))
        self.max_steps_duration = 0.0
        self._load_checkpoint()
        self._before_steps()
        last_val: dict[str, float] = {}
        if cfg.trainer.get("val_before_train", True) and self.val_reward_fn is not None:
            last_val = self._validate()
            if tracker is not None and last_val:
                tracker.log(last_val, step=self.global_steps)
            if cfg.trainer.get("val_only", False):
                return last_val
        progress = _progress(self.total_training_steps, self.global_steps)
        history: list[dict] = []
        self.global_steps += 1
        try:  # the bar is closed on an error too, so the error paragraph starts on its own line
            self._start_steps()
            saved_step = None  # the last step this process checkpointed
            while self.global_steps <= self.total_training_steps:
                if guard.requested:
                    # Before any step of this process (start-up, the first validation): nothing new to save. After
                    # a step whose end the signal just missed (it came while the step was being logged): save it.
                    if not history or saved_step == self.global_steps - 1:
                        raise faults.Preempted(self.global_steps - 1, None, guard.requested)
                    self.global_steps -= 1  # the checkpoint is named after the step it holds
                    with marked_timer("save_checkpoint", self._timing):
                        saved = self._save_checkpoint()
                    raise faults.Preempted(self.global_steps, saved, guard.requested)
                with self.profiler.step(self.global_steps):
                    metrics = self._fit_step()
                self.max_steps_duration = max(self.max_steps_duration, self._timing.get("step", 0.0))
                is_last = self.global_steps >= self.total_training_steps
                preempted = guard.requested is not None and not is_last
                save_freq = cfg.trainer.get("save_freq", -1)
                saving = bool(save_freq and save_freq > 0)
                # upstream's ESI rule: an elastic instance about to expire forces a save (with saving on).
                esi = saving and faults.should_save_ckpt_esi(
                    self.max_steps_duration, redundant_time=float(cfg.trainer.get("esi_redundant_time", 0) or 0))
                saved = None
                if preempted or (saving and (is_last or self.global_steps % save_freq == 0 or esi)):
                    if esi:
                        print("Force saving checkpoint: ESI instance expiration approaching.", flush=True)
                    with marked_timer("save_checkpoint", self._timing):
                        saved = self._save_checkpoint()
                    saved_step = self.global_steps
                    metrics["timing_s/save_checkpoint"] = self._timing["save_checkpoint"]
                    if "timing_s/step" in metrics and "perf/total_num_tokens" in metrics:
                        metrics.update(fold_save_into_step(metrics, self._timing["save_checkpoint"], self.world_size))
                        # the ESI rule's longest step counts saves too, as upstream's
                        self.max_steps_duration = max(self.max_steps_duration, metrics["timing_s/step"])
                test_freq = cfg.trainer.get("test_freq", -1)
                if not preempted and self.val_reward_fn is not None and test_freq and test_freq > 0 and (
                        is_last or self.global_steps % test_freq == 0):
                    last_val = self._validate_now()
                    metrics.update(last_val)
                metrics["training/global_step"] = self.global_steps
                metrics["training/epoch"] = self.train_dataloader.epoch
                if tracker is not None:
                    tracker.log(metrics, step=self.global_steps)
                history.append(metrics)
                progress.update(1)
                if preempted:
                    raise faults.Preempted(self.global_steps, saved, guard.requested)
                self.global_steps += 1
        finally:
            progress.close()
            self._end_steps()
        return {"history": history, "last_val": last_val}

    # Hooks of fit(); the asynchronous trainers (verl.experimental.async_policy) replace them.
    def _before_steps(self) -> None:
        """After the checkpoint is loaded, before validation and the first step."""

    def _start_steps(self) -> None:
        self._batches = self._batch_stream()

    def _fit_step(self) -> dict[str, Any]:
        return self._train_step(next(self._batches))

    def _validate_now(self) -> dict[str, float]:
        return self._validate()

    def _end_steps(self) -> None:
        """After the last step, or on an error."""

    def _batch_stream(self):
        """Prompt batches epoch after epoch (the loader itself advances its epoch and resumable position)."""
        while True:
            yield from self.train_dataloader

    def _generate_and_score(self, batch_dict: dict, timing: dict, metrics: dict) -> DataProto:
        """One generation batch: repeat each prompt rollout.n times, generate, score."""
        batch, gen = self._generation_inputs(batch_dict)
        with marked_timer("gen", timing):
            gen_out = self._dp_call(self.rollout_wg.generate_sequences, gen)
        _split_weight_sync(gen_out, timing)
        return self._score_generation(batch, gen_out, timing, metrics)

    def _generation_inputs(self, batch_dict: dict) -> tuple[DataProto, DataProto]:
        """The training batch (each prompt repeated rollout.n times, with its group uid) and the rollout's part."""
        n = self.config.actor_rollout_ref.rollout.n
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        if self.config.algorithm.adv_estimator == AdvantageEstimator.REMAX.value:  # ReMax: greedy baseline per prompt
            batch.batch["reward_baselines"] = greedy_reward_baselines(self, batch)
        batch = batch.repeat(repeat_times=n, interleave=True)
        gen = self._gen_batch(batch)
        gen.meta_info = {"global_steps": self.global_steps}
        return batch, gen

    def _score_generation(self, batch: DataProto, gen_out: DataProto, timing: dict, metrics: dict) -> DataProto:
        """Merge the rollout's output into the batch and score it."""
        # One metrics dict per data-parallel rank (merged by DataProto.concat); agent-loop ones are logged.
        metrics.update(_combine_agent_loop_metrics(gen_out.meta_info.pop("metrics", None)))
        batch = self._merge_generation(batch, gen_out)
        if "response_mask" not in batch.batch.keys():
            batch.batch["response_mask"] = compute_response_mask(batch)
        with marked_timer("reward", timing):
            batch = self._rm_score(batch)
            scores, extra = compute_reward(batch, self.reward_fn)
            batch.batch["token_level_scores"] = scores
            for k, v in extra.items():
                if len(v) == len(batch):
                    batch.non_tensor_batch[k] = np.array(v, dtype=object)
        if self.genrm_router is not None:  # the judge's requests since the last step, and its verdicts' fate
            from verl.trainer.ppo.genrm import verdict_metrics

            metrics.update(self.genrm_router.pop_metrics())
            metrics.update(verdict_metrics(extra))
        return batch

    def _dynamic_sample(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """DAPO: keep groups with a non-zero spread of filter_groups.metric until train_batch_size prompts."""
        fg = self.config.algorithm.filter_groups
        want = int(self.config.data.train_batch_size)
        cap = int(fg.get("max_num_gen_batches") or 0)
        if self._batches is None:
            self._batches = self._batch_stream()
        kept: list[DataProto] = []
        n_kept, n_seen, num_gen = 0, 0, 1
        while True:
            rows, groups_kept, groups = filter_groups.kept_group_rows(
                batch.non_tensor_batch["uid"], filter_groups.group_metric_values(batch, fg.metric))
            n_kept, n_seen = n_kept + groups_kept, n_seen + groups
            if rows:
                kept.append(batch[rows])
            if n_kept >= want:
                break
            if cap > 0 and num_gen >= cap:
                raise RuntimeError(
                    f"algorithm.filter_groups: after {num_gen} generation batches (max_num_gen_batches={cap}) only "
                    f"{n_kept} of the {want} prompts (data.train_batch_size) needed had responses that disagree on "
                    f"{fg.metric!r} ({n_seen} prompts tried). The data may be too hard or too easy for the model; "
                    "raise max_num_gen_batches (0 = no limit) or data.gen_batch_size, or filter the data set.")
            num_gen += 1
            batch = self._generate_and_score(next(self._batches), timing, metrics)
        metrics["train/num_gen_batches"] = num_gen
        return filter_groups.trim_to_groups(DataProto.concat(kept), want)

    def _train_step(self, batch_dict: dict) -> dict[str, Any]:
        cfg = self.config
        timing: dict[str, float] = {}
        self._timing = timing
        metrics: dict[str, Any] = {}
        with marked_timer("step", timing):
            batch = self._generate_and_score(batch_dict, timing, metrics)
            if cfg.algorithm.get("filter_groups") is not None and cfg.algorithm.filter_groups.get("enable", False):
                batch = self._dynamic_sample(batch, timing, metrics)
            batch = self._train_on_batch(batch, timing, metrics)
        return self._step_metrics(batch, timing, metrics)

    def _step_metrics(self, batch: DataProto, timing: dict, metrics: dict) -> dict[str, Any]:
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(batch, timing))
        metrics.update(compute_throughout_metrics(batch, timing, n_gpus=self.world_size))
        return metrics

    def _rollout_correction_config(self, batch: DataProto):
        """The ``algorithm.rollout_correction`` section applied to ``batch`` (the asynchronous trainers add a
        default correction for stale samples)."""
        return self.config.algorithm.get("rollout_correction")

    def _train_on_batch(self, batch: DataProto, timing: dict, metrics: dict) -> DataProto:
        """Everything after generation and scoring: old/ref log-probs, values, advantages, the updates."""
        cfg = self.config
        n = cfg.actor_rollout_ref.rollout.n
        rc = self._rollout_correction_config(batch)
        bypass = bool(rc is not None and rc.get("bypass_mode", False))
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
        with marked_timer("old_log_prob", timing):
            if bypass:  # rollout_correction.bypass_mode: the rollout's log-probs are pi_old
                if "rollout_log_probs" not in batch.batch.keys():
                    raise ValueError("algorithm.rollout_correction.bypass_mode needs rollout_log_probs from the "
                                     "rollout engine; this rollout did not return them")
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
            else:
                old = self._dp_call(self.actor_rollout_wg.compute_log_prob, batch)
                if "entropys" in old.batch.keys():
                    ent = old.batch.pop("entropys")
                    metrics["actor/entropy"] = core_algos.agg_loss(
                        ent, batch.batch["response_mask"].float(),
                        cfg.actor_rollout_ref.actor.loss_agg_mode).item()
                old.meta_info = {}
                batch = batch.union(old)
                if "rollout_log_probs" in batch.batch.keys():  # the rollout/trainer gap, every step
                    metrics.update(rollout_corr.rollout_probs_diff_metrics(
                        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                        batch.batch["response_mask"]))
                if rollout_corr.is_enabled(rc):
                    metrics.update(rollout_corr.apply_rollout_correction(batch, rc))
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self._dp_call(self.actor_rollout_wg.compute_ref_log_prob, batch))
        if self.use_distillation:  # the teacher scores the same rollouts, as the reference does
            with marked_timer("teacher", timing):
                batch = batch.union(self._dp_call(self.actor_rollout_wg.compute_teacher_log_prob, batch))
        if self.use_critic:
            with marked_timer("values", timing):
                batch = batch.union(self._dp_call(self.critic_wg.compute_values, batch))
        with marked_timer("adv", timing):
            if cfg.algorithm.use_kl_in_reward:
                batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=self.kl_ctrl_in_reward,
                                                     kl_penalty=cfg.algorithm.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = compute_advantage(batch, cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma,
                                      lam=cfg.algorithm.lam, num_repeat=n,
                                      norm_adv_by_std_in_grpo=cfg.algorithm.get("norm_adv_by_std_in_grpo", True),
                                      config=cfg.algorithm)
        if self.use_critic:
            with marked_timer("update_critic", timing):
                per_rank = self._metric_call(self.critic_wg.update_critic, batch)
            metrics.update(self._nonfinite_check("critic", per_rank, ("critic/vf_loss",)))
            metrics.update(_mean_over_ranks(per_rank))
        if self.global_steps > cfg.trainer.get("critic_warmup", 0):
            with marked_timer("update_actor", timing):
                batch.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
                per_rank = self._metric_call(self.actor_rollout_wg.update_actor, batch)
            metrics.update(self._nonfinite_check("actor", per_rank, ("actor/pg_loss", "actor/distillation/loss")))
            metrics.update(_mean_over_ranks(per_rank))
        return batch

    def _nonfinite_check(self, role: str, per_rank, loss_keys) -> dict:
        """``trainer.on_nonfinite``: log the updates the engine dropped for a NaN/inf gradient, or stop."""
        mode = getattr(self, "_on_nonfinite", None) or str(self.config.trainer.get("on_nonfinite", "skip"))
        return faults.nonfinite_update_check(role, per_rank, self.global_steps, mode, loss_keys)

    def _metric_call(self, method, batch: DataProto):
        dp = self._dp_size(method)
        padded, pad = pad_dataproto_to_divisor(batch, dp)
        if pad:
            raise ValueError(f"the training batch ({len(batch)} responses) must divide by the data-parallel size "
                             f"{dp}; adjust data.train_batch_size or rollout.n")
        return method(padded)


def _rank_lists(rank_metrics) -> dict[str, list]:
    """The workers' per-rank metrics (concat's dict of lists, or a list of per-rank dicts) as key -> values."""
    if isinstance(rank_metrics, (list, tuple)):
        merged: dict[str, list] = {}
        for m in rank_metrics:
            for k, v in (m or {}).items():
                merged.setdefault(k, []).append(v)
        return merged
    return {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in (rank_metrics or {}).items()}


def _split_weight_sync(gen_out: DataProto, timing: dict) -> None:
    """The weight sync the workers ran at the start of generating (only when the weights changed or the engine
    discarded them) as upstream's own phase, ``timing_s/update_weights`` (the slowest rank's), out of
    ``timing_s/gen``: upstream syncs after the update, outside the generation timer."""
    values = [float(v) for v in _rank_lists(gen_out.meta_info.get("metrics")).get("timing_s/update_weights", [])]
    if values and max(values) > 0:
        timing["update_weights"] = max(values)
        timing["gen"] = max(0.0, timing["gen"] - timing["update_weights"])


def _combine_agent_loop_metrics(rank_metrics) -> dict[str, float]:
    """The ranks' ``agent_loop/*`` aggregates as one: ``/max`` by max, ``/min`` by min, the rest by mean
    (ranks hold equally many samples); the rollout's ``perf/*`` figures (device memory around its sleep) by
    max, the worst rank being what fits or not; speculative decoding's per-request means (``rollout/spec_*``)
    by mean. Accepts concat's dict of lists or a list of per-rank dicts."""
    out: dict[str, float] = {}
    for k, v in _rank_lists(rank_metrics).items():
        if not k.startswith(("agent_loop/", "perf/", "rollout/spec_")):
            continue
        vals = [float(x) for x in v]
        worst = k.endswith("/max") or k.startswith("perf/")
        out[k] = max(vals) if worst else min(vals) if k.endswith("/min") else sum(vals) / len(vals)
    return out


def _mean_over_ranks(per_rank: list[dict]) -> dict[str, float]:
    merged: dict[str, list] = {}
    for m in per_rank:
        for k, v in m.items():
            merged.setdefault(k, []).extend(v if isinstance(v, list) else [v])
    return reduce_metrics(merged)


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, start: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, initial=start, desc="Training Progress", dynamic_ncols=True)
