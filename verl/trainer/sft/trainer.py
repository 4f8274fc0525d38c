"""The SFT training loop, written against the training-engine interface only (FSDP and Megatron alike).

One process per device (``torchrun``) or a single process. Every rank loads each global batch, keeps its
data-parallel share (see :mod:`verl.trainer.sft.batches`) and hands it to the engine with the SFT loss; the
engine splits it into micro-batches, packs them when remove-padding is on, and steps the optimizer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, open_dict

from verl.trainer.sft.batches import (
    EpochOrder,
    GlobalBatchSampler,
    eval_batches,
    global_target_tokens,
    rows_to_dataproto,
    split_for_rank,
)
from verl.trainer.sft.loss import make_sft_loss, token_nll_sum
from verl.utils.checkpoint import step_dirs as ckpt_dirs
from verl.utils.checkpoint.step_dirs import LATEST_FILE  # noqa: F401 (its public name here)
from verl.utils.py_functional import CheckError
from verl.utils.user_errors import DeferredRowErrors, GuardedDataset, UserFacingError, guard, raise_row_failures

logger = logging.getLogger(__name__)

STATE_FILE = "sft_state.json"
BUDGET_KEY = "data.max_token_len_per_gpu"  # named by the engine's dynamic-batch errors (meta max_token_len_key)
_DATA_HINT = ("The files are data.train_files / data.val_files, the columns data.messages_key, data.tools_key, "
              "data.enable_thinking_key (data.custom_cls: your own dataset class); set VERL_DEBUG=1 for the full "
              "traceback.")

__all__ = ["SFTTrainer", "LATEST_FILE"]


def _rows(batch: list[dict]) -> list[dict]:
    return batch  # DataLoader collate: keep the rows; sharding and padding happen per rank


def _frequency(value, steps_per_epoch: int, key: str) -> int:
    if value == "after_each_epoch":
        return steps_per_epoch
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r}; use a number of steps, -1 or after_each_epoch")
    return value


class SFTTrainer:
    """Build with the composed config and an engine strategy name, then :meth:`fit`."""

    def __init__(self, config: DictConfig, strategy: str):
        self.config = config
        self.strategy = strategy
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._build_tokenizer()
        self._build_datasets()
        self._plan_steps()
        self._build_engine()

    # ------------------------------------------------------------------ setup
    def _build_tokenizer(self) -> None:
        from verl.utils.tokenizer import load_tokenizer_and_processor

        # section="model": a bad path or a missing chat template is reported with SFT's key names.
        self.tokenizer, self.processor = load_tokenizer_and_processor(self.config.model, section="model")

    def _build_datasets(self) -> None:
        from verl.trainer.sft.dataset import create_sft_dataset

        d = self.config.data
        # Reading the files (and, for the built-in dataset, checking every row's structure) happens here; a
        # row that fails later, while it is tokenised, is reported by GuardedDataset with its index.
        with guard("Data", _DATA_HINT):
            train = create_sft_dataset(d.train_files, d, self.tokenizer, self.processor,
                                       max_samples=d.get("train_max_samples", -1))
            val = (create_sft_dataset(d.val_files, d, self.tokenizer, self.processor,
                                      max_samples=d.get("val_max_samples", -1)) if d.get("val_files") else None)
        self.train_dataset = GuardedDataset(train, "data.train_files")
        self.val_dataset = GuardedDataset(val, "data.val_files") if val is not None else None
        self.pad_token_id = getattr(self.train_dataset, "pad_token_id", None)
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.pad_token_id

    def _plan_steps(self) -> None:
        cfg = self.config
        self.batch_size = int(cfg.data.train_batch_size)
        self.steps_per_epoch = len(self.train_dataset) // self.batch_size
        if self.steps_per_epoch == 0:
            raise UserFacingError("Data", f"data.train_batch_size={self.batch_size} is larger than the training "
                                  f"set ({len(self.train_dataset)} rows of data.train_files)",
                                  "Lower data.train_batch_size or add rows (data.train_max_samples may cap them).")
        total = cfg.trainer.get("total_training_steps")
        self.total_steps = int(total) if total else self.steps_per_epoch * int(cfg.trainer.total_epochs)
        self.save_freq = _frequency(cfg.trainer.save_freq, self.steps_per_epoch, "trainer.save_freq")
        self.test_freq = _frequency(cfg.trainer.test_freq, self.steps_per_epoch, "trainer.test_freq")
        with open_dict(cfg):
            cfg.optim.total_training_steps = self.total_steps
        self.order = EpochOrder(len(self.train_dataset), int(cfg.trainer.seed), bool(cfg.data.get("shuffle", True)))

    def _build_engine(self) -> None:
        from verl.workers.engine import EngineRegistry

        engine_cls = EngineRegistry.get_or_raise(self.strategy)
        self.engine = engine_cls(model_config=self.config.model, engine_config=self.config.engine,
                                 optimizer_config=self.config.optim, checkpoint_config=self.config.checkpoint,
                                 role="sft", processing_class=self.processor or self.tokenizer)
        self.engine.initialize()

    def _meta(self) -> dict:
        d = self.config.data
        return {"micro_batch_size": int(d.micro_batch_size_per_gpu), "use_dynamic_bsz": bool(d.use_dynamic_bsz),
                "max_token_len": int(d.max_token_len_per_gpu), "max_token_len_key": BUDGET_KEY, "temperature": 1.0}

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> str:
        return ckpt_dirs.checkpoint_root(self.config.trainer.default_local_dir)

    def _resume_dir(self) -> Optional[str]:
        path = ckpt_dirs.resume_dir(self.config.trainer, error=lambda msg: UserFacingError("Config", msg))
        if path is not None and self.config.trainer.resume_mode == "resume_path" and not os.path.isdir(path):
            raise UserFacingError("Config", f"trainer.resume_from_path={path} does not exist",
                                  "Point it at a checkpoint directory of an earlier run, or set "
                                  "trainer.resume_mode=auto or disable.")
        return path

    def load_checkpoint(self) -> dict:
        """Restore the engine and the data position; returns the trainer state (zeros for a fresh start)."""
        state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "total_tokens": 0}
        path = self._resume_dir()
        if path is None:
            return state
        # A missing, truncated or partial checkpoint is refused naming the file (verl/utils/checkpoint/step_dirs.py).
        ckpt_dirs.check_resumable(path)
        with ckpt_dirs.loading(path):
            try:
                with open(os.path.join(path, STATE_FILE)) as f:
                    state.update(json.load(f))
            except (OSError, ValueError) as err:
                raise ckpt_dirs.CheckpointError(f"checkpoint file {os.path.join(path, STATE_FILE)} cannot be read "
                                                f"({type(err).__name__}: {err})") from err
            self.engine.load_checkpoint(path)
        if self.rank == 0:
            print(f"Resumed from {path} (global step {state['global_step']})", flush=True)
        return state

    def save_checkpoint(self, state: dict) -> str:
        """Every rank's part, the trainer state, the manifest, then the marker. A failed write (a full disk)
        removes the partial directory and leaves the previous checkpoint marked (a CheckpointError)."""
        root = self._ckpt_root()
        path = ckpt_dirs.step_dir(root, state["global_step"])
        try:
            self.engine.save_checkpoint(path, global_step=state["global_step"])
            if self.rank == 0:
                os.makedirs(path, exist_ok=True)
                tmp = os.path.join(path, STATE_FILE + ".tmp")
                with open(tmp, "w") as f:
                    json.dump(state, f)
                os.replace(tmp, os.path.join(path, STATE_FILE))
            if dist.is_initialized():
                dist.barrier()
            if self.rank == 0:
                ckpt_dirs.write_manifest(path)
        except ckpt_dirs.CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to write leaves the old checkpoint in charge
            raise ckpt_dirs.save_failed(root, path, err) if self.rank == 0 else err
        if self.rank == 0:
            # The marker moves only once every rank's part is on disk.
            ckpt_dirs.mark_latest(root, state["global_step"])
            self._prune(root)
        return path

    def _prune(self, root: str) -> None:
        # SFT's key is trainer.max_ckpt_to_keep (PPO's: max_actor_ckpt_to_keep); the rule is the shared one.
        ckpt_dirs.prune_steps(root, self.config.trainer.get("max_ckpt_to_keep"))

    # ------------------------------------------------------------------ steps
    def _all_sum(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            from verl.utils.device import get_device_id, get_device_name

            # nccl reduces device tensors only; gloo (CPU) host tensors.
            t = t.to("cpu" if get_device_name() == "cpu" else f"{get_device_name()}:{get_device_id()}")
            dist.all_reduce(t)
        return t.cpu().tolist()

    def _nll(self, outputs: dict, data, weights: Optional[list[bool]] = None) -> tuple[float, float]:
        """This rank's (token NLL sum, token count); ranks whose outputs are copies (TP, non-last PP) give 0."""
        if not self.engine.is_mp_src_rank_with_outputs():
            return 0.0, 0.0
        mask = data.batch["loss_mask"]
        if weights is not None:
            mask = mask * torch.tensor(weights, dtype=mask.dtype).unsqueeze(-1)
        nll, count = token_nll_sum(outputs["log_probs"].float(), mask)
        return float(nll), float(count)

    def train_step(self, rows: list[dict]) -> dict:
        """One optimizer step on one global batch (every rank passes the same ``rows``)."""
        t0 = time.perf_counter()
        mine = split_for_rank(rows, self.engine.dp_size, self.engine.dp_rank,
                              bool(self.config.trainer.get("balance_batch", True)))
        data = rows_to_dataproto(mine, self.pad_token_id, self._meta())
        loss_fn = make_sft_loss(global_target_tokens(rows), self.engine.dp_size)
        with self.engine.train_mode():
            self.engine.optimizer_zero_grad()
            try:
                result = self.engine.forward_backward_batch(data, loss_fn, forward_only=False, outputs=("log_probs",))
            except CheckError as err:
                if BUDGET_KEY not in str(err):
                    raise
                # Every rank agrees on the budget check before raising, so all of them stop here.
                raise UserFacingError("Config", str(err), "The token budget must hold the longest conversation "
                                      "of a batch (data.max_length with data.pad_mode=right).") from err
            grad_norm = self.engine.optimizer_step()
        lr = self.engine.lr_scheduler_step()
        nll, count = self._all_sum(*self._nll(result["outputs"], data))
        seconds = time.perf_counter() - t0
        tokens = sum(int(r["attention_mask"].sum()) for r in rows)
        # Upstream's SFT trainer logs the engine's MTP losses under their own name (mtp_losses/mtp_1_loss).
        metrics = {(k if k.startswith("mtp_losses/") else f"train/{k}"): v
                   for k, v in (result.get("metrics") or {}).items()}
        metrics.update({"train/loss": nll / max(count, 1.0), "train/grad_norm": float(grad_norm), "train/lr": float(lr),
                        "train/global_tokens": tokens, "train/tokens_per_second": tokens / max(seconds, 1e-9),
                        "train/step_time(s)": seconds})
        return metrics

    def validate(self) -> dict:
        if self.val_dataset is None:
            return {}
        per_rank = int(self.config.data.micro_batch_size_per_gpu)
        total_nll = total_count = 0.0
        for idx, weights in eval_batches(len(self.val_dataset), per_rank, self.engine.dp_size, self.engine.dp_rank):
            data = rows_to_dataproto([self.val_dataset[i] for i in idx], self.pad_token_id, self._meta())
            outputs = self.engine.infer_batch(data, outputs=("log_probs",))
            nll, count = self._nll(outputs, data, weights)
            total_nll += nll
            total_count += count
        nll, count = self._all_sum(total_nll, total_count)
        return {"val/loss": nll / max(count, 1.0)}

    # ------------------------------------------------------------------ loop
    def _loader(self, epoch: int, start: int):
        from torch.utils.data import DataLoader

        workers = int(self.config.data.get("num_workers", 0) or 0)
        # A worker process cannot re-raise a UserFacingError as itself: failing rows come back as values and
        # are raised again here (raise_row_failures in fit).
        return DataLoader(DeferredRowErrors(self.train_dataset),
                          batch_sampler=GlobalBatchSampler(self.order, self.batch_size, epoch, start),
                          collate_fn=_rows, num_workers=workers, persistent_workers=False)

    def _stop_requested(self, guard) -> Optional[str]:
        """Whether any rank got SIGTERM (all ranks agree, so they save and stop together)."""
        flag = 1.0 if guard.requested else 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = self._all_sum(flag)[0]
        return (guard.requested or "SIGTERM") if flag > 0 else None

    def fit(self, tracker=None) -> dict:
        """Train to ``total_steps``; returns ``{"history": [metrics per logged step], "checkpoint": last path}``.

        SIGTERM finishes the current step, saves it and raises :class:`verl.trainer.faults.Preempted`; a NaN/inf
        gradient norm is logged (``trainer.on_nonfinite=skip``) or stops the run (``error``)."""
        from verl.trainer import faults

        with faults.PreemptionGuard() as guard:
            return self._fit(tracker, guard, faults)

    def _fit(self, tracker, guard, faults) -> dict:
        on_nonfinite = faults.check_nonfinite_mode(str(self.config.trainer.get("on_nonfinite", "skip")))
        state = self.load_checkpoint()
        history: list[dict] = []
        last_ckpt = None
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=state["global_step"], desc="SFT", dynamic_ncols=True)
        try:
            epoch, start = state["epoch"], state["step_in_epoch"]
            while state["global_step"] < self.total_steps:
                for rows in self._loader(epoch, start):
                    metrics = self.train_step(raise_row_failures(rows))
                    metrics.update(faults.nonfinite_update_check(
                        "train", [metrics], state["global_step"] + 1, on_nonfinite, ("train/loss",), label="SFT"))
                    state["global_step"] += 1
                    state["step_in_epoch"] += 1
                    if state["step_in_epoch"] == self.steps_per_epoch:
                        state["epoch"], state["step_in_epoch"] = state["epoch"] + 1, 0
                    state["total_tokens"] += metrics["train/global_tokens"]
                    metrics["train/total_tokens(B)"] = state["total_tokens"] / 1e9
                    metrics["train/epoch"] = epoch
                    step = state["global_step"]
                    last = step >= self.total_steps
                    stop = None if last else self._stop_requested(guard)
                    if not stop and self.test_freq > 0 and (step % self.test_freq == 0 or last):
                        metrics.update(self.validate())
                    if stop or (self.save_freq > 0 and (step % self.save_freq == 0 or last)):
                        last_ckpt = self.save_checkpoint(dict(state))
                    metrics["training/global_step"] = step
                    history.append(metrics)
                    if tracker is not None and self.rank == 0:
                        tracker.log({k: v for k, v in metrics.items() if k != "training/global_step"}, step=step)
                    if bar is not None:
                        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                        bar.update(1)
                    if stop:
                        raise faults.Preempted(step, last_ckpt, stop)
                    if last:
                        break
                epoch, start = state["epoch"], state["step_in_epoch"]
        finally:
            if bar is not None:
                bar.close()  # the bar ends its line, so an error paragraph starts on its own
        return {"history": history, "checkpoint": last_ckpt}
