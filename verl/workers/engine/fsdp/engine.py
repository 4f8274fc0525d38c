"""The FSDP2 training engine: one Hugging Face model sharded with ``fully_shard``, plus its optimizer,
scheduler and checkpoints, behind :class:`verl.workers.engine.base.BaseEngine`.

Roles (actor, reference, critic, SFT) hand it batches and loss functions; it owns micro-batching (fixed size
or dynamic token budget), remove-padding packing, Ulysses sequence parallelism, fused log-prob kernels,
activation offload, gradient clipping and the optimizer/param offload between phases.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.utils import torch_functional as verl_F
from verl.utils.device import get_device_name
from verl.utils.model_output import get_logits
from verl.workers.engine.base import BaseEngine, LossFn, accumulate_metrics

from .micro_batches import split_micro_batches
from .model_init import build_lr_scheduler, build_module, build_optimizer, uses_cpu_offload_policy
from .packing import pack_micro_batch, unpack_to_padded
from verl.utils.config import cfg_get

logger = logging.getLogger(__name__)

_alias_warned = False
_sp_groups: dict[tuple[int, int], Any] = {}


def warn_fsdp_alias(strategy: Optional[str]) -> bool:
    """``strategy=fsdp`` runs FSDP2: say so once per process (upstream's fsdp means FSDP1)."""
    global _alias_warned
    if strategy != "fsdp" or _alias_warned:
        return False
    _alias_warned = True
    message = ("strategy=fsdp: this project builds FSDP2 only, so the run uses FSDP2 (fully_shard); set "
               "strategy=fsdp2 to silence this warning")
    logger.warning(message)
    if not dist.is_initialized() or dist.get_rank() == 0:  # worker logs reach the driver's output via stdout
        print(f"[verl.engine] WARNING: {message}", flush=True)
    return True


def compute_device() -> torch.device:
    name = get_device_name()
    if name == "cpu":
        return torch.device("cpu")
    from verl.utils.device import get_torch_device

    return torch.device(name, get_torch_device().current_device())


def sequence_parallel_group(sp: int):
    """The Ulysses group of this rank (None without SP): a (dp, sp) mesh, consecutive ranks sharing data.
    FSDP2 still shards over all ranks; its gradient average over dp*sp is corrected by the sp factor that
    ``gather_outputs_and_unpad`` applies in the backward. Cached: every engine of a process shares it."""
    if sp <= 1:
        return None
    world = dist.get_world_size()
    if world % sp:
        raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the world size {world}")
    if (world, sp) not in _sp_groups:
        from torch.distributed.device_mesh import init_device_mesh

        device = get_device_name()
        mesh = init_device_mesh("cpu" if device == "cpu" else device, (world // sp, sp), mesh_dim_names=("dp", "sp"))
        _sp_groups[(world, sp)] = mesh["sp"].get_group()
    return _sp_groups[(world, sp)]


@contextlib.contextmanager
def ulysses_group(group):
    """Registers ``group`` as the Ulysses SP group for the block: set only around this engine's forwards, so
    a colocated engine without SP never sees it."""
    from verl.utils import ulysses

    prev = ulysses.get_ulysses_sequence_parallel_group()
    if group is not None:
        ulysses.set_ulysses_sequence_parallel_group(group)
    try:
        yield
    finally:
        ulysses.set_ulysses_sequence_parallel_group(prev)


class FSDPEngine(BaseEngine):
    """Keyword arguments beyond the base ones:

    ``role_config``: the whole role section (``actor_rollout_ref.actor`` / ``.ref`` / ``critic``) for keys that
    live there upstream (``ulysses_sequence_parallel_size``, ``grad_clip``, ``use_fused_kernels``);
    ``strategy``: the name the user chose (``fsdp`` logs the FSDP2 warning); ``share_module_with``: another
    engine whose (LoRA) module this one uses with its adapters disabled (the LoRA reference policy: no second
    base model); ``processing_class``: tokenizer/processor saved next to checkpoints.
    """

    def __init__(self, model_config, engine_config, optimizer_config=None, checkpoint_config=None,
                 role: str = "actor", *, role_config=None, strategy: str = "fsdp2",
                 share_module_with: Optional["FSDPEngine"] = None, processing_class=None, **kwargs):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, role=role)
        warn_fsdp_alias(strategy)
        self.role_config = role_config if role_config is not None else {}
        self.share_module_with = share_module_with
        self.processing_class = processing_class
        self.sp_size = int(cfg_get(self.role_config, "ulysses_sequence_parallel_size", 0)
                           or cfg_get(engine_config, "ulysses_sequence_parallel_size", 1) or 1)
        self.optimizer = None
        self.lr_scheduler = None
        self.checkpoint_manager = None
        self._module: Optional[torch.nn.Module] = None
        self.device = compute_device()
        self.cpu_offload_policy = uses_cpu_offload_policy(engine_config)
        # Under the CPU offload policy the optimizer state already lives (and steps) in host memory.
        self.offload_optimizer = bool(cfg_get(engine_config, "optimizer_offload", False)) and not self.cpu_offload_policy
        # Offloading activations only pays where there is a backward pass.
        self.activation_offload = (bool(cfg_get(model_config, "enable_activation_offload", False))
                                   and self.role_spec.trainable)
        # fsdp_config.router_replay.mode (the twin of upstream's megatron.router_replay.mode): disabled, R2, R3
        self.router_replay_mode = str(cfg_get(cfg_get(engine_config, "router_replay", None) or {}, "mode",
                                              "disabled") or "disabled")
        self._tape = None

    # ------------------------------------------------------------------------------------ life cycle
    def initialize(self) -> None:
        self.sp_group = sequence_parallel_group(self.sp_size) if dist.is_initialized() else None
        if self.share_module_with is not None:
            other = self.share_module_with
            self._module, self.built = other.module, other.built
            self.is_lora = False
            self._disable_adapter = other.is_lora
        else:
            trainable = self.role_spec.trainable
            use_fused = cfg_get(self.role_config, "use_fused_kernels", None)
            self.built = build_module(
                self.model_config, self.engine_config, role=self.role, ulysses_sp_size=self.sp_size,
                enable_gc=trainable and bool(cfg_get(self.model_config, "enable_gradient_checkpointing", False)),
                use_fused_kernels=None if use_fused is None else bool(use_fused))
            self._module = self.built.module
            self.is_lora = self.built.is_lora
            self._disable_adapter = False
            if trainable:
                self.optimizer = build_optimizer(self._module, self.optimizer_config)
                self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optimizer_config)
                from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

                self.checkpoint_manager = FSDPCheckpointManager(
                    self._module, self.optimizer, self.lr_scheduler, processing_class=self.processing_class,
                    checkpoint_config=self.checkpoint_config)
        mtp = self.built.info.get("mtp") or {}
        # The MTP head is loaded (and saved) with mtp.enable; its loss is added only with mtp.enable_train.
        self.mtp_runner = mtp.get("runner") if mtp.get("train") else None
        self.mtp_scale = float(mtp.get("scale", 0.1))
        self.use_remove_padding = self.built.use_remove_padding
        # Follows how the module was patched (a LoRA reference shares the actor's patched forward).
        self.use_fused_kernels = self.built.use_fused_kernels
        self._entropy_fn = self._make_entropy_fn()
        if self.router_replay_mode != "disabled":
            if self.sp_size > 1:
                raise ValueError("fsdp_config.router_replay.mode with ulysses_sequence_parallel_size > 1 is not "
                                 "implemented (the routes would need the same sequence-parallel slicing)")
            from verl.models.transformers.router_replay import RouterTape

            self._tape = RouterTape(self._module)
            if self._tape.shape is None:
                raise ValueError(f"fsdp_config.router_replay.mode={self.router_replay_mode} needs a MoE model with "
                                 "top-k routers; this model has none")

    def _make_entropy_fn(self):
        """Entropy from logits, chunked and/or ``torch.compile``d as ``fsdp_config`` says (upstream's
        ``entropy_from_logits_with_chunking`` / ``use_torch_compile``)."""
        cfg = self.engine_config
        if bool(cfg_get(cfg, "entropy_from_logits_with_chunking", False)):
            chunk = int(cfg_get(cfg, "entropy_from_logits_chunk_size", 2048))

            def fn(logits):
                shape = logits.shape
                return verl_F.entropy_from_logits_with_chunking(logits.reshape(-1, shape[-1]), chunk).view(shape[:-1])
        else:
            fn = verl_F.entropy_from_logits
        # fsdp_config.use_torch_compile (the engine's key) and the role's use_torch_compile (actor/ref)
        if bool(cfg_get(cfg, "use_torch_compile", True)) and bool(cfg_get(self.role_config, "use_torch_compile", True)):
            from .compile import maybe_compile

            fn = maybe_compile(fn)
        if bool(cfg_get(cfg, "entropy_checkpointing", False)):
            inner = fn

            def fn(logits):  # recompute in backward instead of keeping the softmax
                if torch.is_grad_enabled() and logits.requires_grad:
                    return torch.utils.checkpoint.checkpoint(inner, logits, use_reentrant=False)
                return inner(logits)
        return fn

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @contextlib.contextmanager
    def train_mode(self):
        self._module.train()
        yield

    @contextlib.contextmanager
    def eval_mode(self):
        was_training = self._module.training
        self._module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self._module.train(was_training)

    # ------------------------------------------------------------------------------------ topology
    @property
    def dp_size(self) -> int:
        return (dist.get_world_size() // self.sp_size) if dist.is_initialized() else 1

    @property
    def dp_rank(self) -> int:
        return (dist.get_rank() // self.sp_size) if dist.is_initialized() else 0

    # ------------------------------------------------------------------------------------ compute
    def _global_batch_info(self, data: DataProto) -> dict:
        """Token and sequence counts of the whole mini-batch across data-parallel ranks (the loss mask is
        ``response_mask``, else ``loss_mask``, else ``attention_mask``).

        The ranks of one Ulysses SP group hold the same rows, so the sum over all ranks counts each row sp
        times; dividing by sp gives the count over data-parallel groups."""
        batch = data.batch
        key = next(k for k in ("response_mask", "loss_mask", "attention_mask") if k in batch.keys())
        mask = batch[key]
        counts = torch.tensor([mask.sum().item(), (mask.sum(-1) > 0).sum().item()], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = counts.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(counts)
            counts = counts.cpu() / self.sp_size
        return {"dp_size": self.dp_size, "batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item()}

    def forward_backward_batch(self, data: DataProto, loss_fn: Optional[LossFn] = None, forward_only: bool = False,
                               outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        meta = data.meta_info
        temperature = float(meta.get("temperature", 1.0))
        train = loss_fn is not None and not forward_only
        global_info = self._global_batch_info(data) if loss_fn is not None else None
        micro, order = split_micro_batches(data, meta.get("micro_batch_size"), bool(meta.get("use_dynamic_bsz", False)),
                                           meta.get("max_token_len"), self.sp_size, self.device,
                                           with_mm=self.role_spec.multimodal, budget_key=meta.get("max_token_len_key"))
        collected: dict[str, list[torch.Tensor]] = {k: [] for k in outputs}
        if "routed_experts" in outputs and self._tape is None:
            raise ValueError("routed_experts requested from an engine without router_replay.mode")
        per_micro: list[dict] = []
        mtp = self.mtp_runner if train else None
        mtp_totals = [0.0, 0.0] * (mtp.head.num_layers if mtp is not None else 0)
        with ulysses_group(self.sp_group), self._adapter_context():
            for mb in micro:
                # The routing context spans backward too: activation checkpointing re-runs the routers there.
                with self._routing(mb, outputs):
                    with self._activation_offload(train), self._mtp_armed(mtp, mb) as pending:
                        out = self._forward_micro_batch(mb, temperature, outputs)
                    if loss_fn is not None:
                        mb["global_batch_info"] = global_info
                        loss, metrics = loss_fn(out, mb)
                        if pending is not None:
                            loss = loss + self._mtp_loss(pending, global_info, mtp_totals)
                        if train:
                            loss.backward()
                        per_micro.append(metrics)
                for k in outputs:
                    v = out[k].detach()
                    collected[k].append(v.cpu() if k == "routed_experts" else v.float().cpu())
        result = {k: torch.cat(v, dim=0) for k, v in collected.items() if v}
        if order is not None:
            from verl.utils.seqlen_balancing import get_reverse_idx

            rev = torch.tensor(get_reverse_idx(order), dtype=torch.long)
            result = {k: v[rev] for k, v in result.items()}
        metrics = accumulate_metrics(per_micro, getattr(loss_fn, "summed_metrics", ()))
        for k in range(len(mtp_totals) // 2):
            # Upstream's metric name (Megatron's "mtp_1 loss" under mtp_losses/): the token-mean CE of depth k+1.
            metrics[f"mtp_losses/mtp_{k + 1}_loss"] = mtp_totals[2 * k] / max(mtp_totals[2 * k + 1], 1.0)
        return {"outputs": result, "metrics": metrics}

    # ------------------------------------------------------------------------------------ MTP
    def _mtp_armed(self, runner, mb: dict):
        """Arms the MTP hooks with this micro-batch's packed-row token ids and loss targets (null context
        without MTP training). The packed row is the real tokens in row order: ``pack_micro_batch`` and the
        padded forward both gather them by the attention mask."""
        if runner is None:
            return contextlib.nullcontext()
        ids, mask = mb["input_ids"], mb["attention_mask"]
        if "response_mask" in mb:  # RL: responses are the last R columns of input_ids
            targets = torch.zeros_like(mask)
            resp = mb["response_mask"]
            targets[:, mask.shape[1] - resp.shape[1]:] = resp.to(mask.dtype)
        elif "loss_mask" in mb:  # SFT: full-length mask of the assistant tokens
            targets = mb["loss_mask"]
        else:
            targets = mask
        keep = mask.reshape(-1).bool()
        return runner.armed(ids.reshape(-1)[keep], targets.reshape(-1)[keep].bool())

    def _mtp_loss(self, pending, global_info: dict, totals: list) -> torch.Tensor:
        """``mtp_loss_scaling_factor / num_layers`` times each depth's CE, as a share of the mini-batch's
        per-token mean: the same global token count (and data-parallel factor) the base losses divide by."""
        if len(pending.sums) != len(totals) // 2:
            raise RuntimeError("the MTP head did not run in this forward (the text model's final norm was not "
                               "reached through the patched forward)")
        scale = self.mtp_scale / len(pending.sums) * global_info["dp_size"] / max(global_info["batch_num_tokens"], 1.0)
        loss = 0.0
        for k, (ce_sum, count) in enumerate(zip(pending.sums, pending.counts)):
            totals[2 * k] += float(ce_sum.detach())
            totals[2 * k + 1] += count
            loss = loss + ce_sum * scale
        return loss

    def _adapter_context(self):
        if self._disable_adapter:
            return self._module.disable_adapter()
        return contextlib.nullcontext()

    def _activation_offload(self, train: bool):
        """``model.enable_activation_offload``: tensors saved for backward live in CPU memory until backward
        needs them (trades host<->device copies for activation memory); training passes only."""
        if not (train and self.activation_offload):
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())

    @staticmethod
    def _real_index(mb: dict) -> torch.Tensor:
        """Positions of the real tokens in the flattened (B*L) layout: the index ``pack_micro_batch`` takes
        input_ids with, and the one the patched Qwen3.5 forward packs a padded batch with."""
        return mb["attention_mask"].reshape(-1).nonzero(as_tuple=False).squeeze(-1)

    def _routing(self, mb: dict, outputs: tuple[str, ...]):
        """Router replay around one micro-batch's forward and backward: record (``routed_experts`` asked for:
        R2's old-log-prob pass) or replay ``mb['routed_experts']`` (B, L, moe_layers, k), taken at the real
        tokens exactly as input_ids are packed (or in the full B*L order, for a forward that routes padding).
        """
        if self._tape is None:
            return contextlib.nullcontext()
        if "routed_experts" in outputs:
            return self._tape.recording()
        routes = mb.get("routed_experts")
        if routes is None:
            return contextlib.nullcontext()
        flat = routes.reshape(-1, *routes.shape[2:])
        return self._tape.replaying((flat.index_select(0, self._real_index(mb)), flat))

    def _recorded_routes(self, mb: dict) -> torch.Tensor:
        """The routes recorded in the last forward back in the padded (B, L, moe_layers, k) layout, -1 at
        padding."""
        rec = self._tape.stacked().to(torch.int16)
        bsz, seqlen = mb["input_ids"].shape
        real = self._real_index(mb)
        full = torch.full((bsz * seqlen, *rec.shape[1:]), -1, dtype=rec.dtype, device=rec.device)
        if rec.shape[0] == real.numel():
            full[real] = rec
        elif rec.shape[0] == bsz * seqlen:
            full[real] = rec[real]
        else:
            raise RuntimeError(f"router replay: the routers saw {rec.shape[0]} tokens; the micro-batch has "
                               f"{real.numel()} real tokens in {bsz} x {seqlen}")
        return full.view(bsz, seqlen, *rec.shape[1:])

    def _forward_micro_batch(self, mb: dict, temperature: float, outputs: tuple[str, ...]) -> dict:
        """Model outputs for one micro-batch in the padded (B, L) layout, next-token aligned."""
        mm_inputs = mb.get("multi_modal_inputs") or {}
        if self.use_remove_padding:
            packed = pack_micro_batch(mb, sp_size=self.sp_size)
            out = self._module(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                               use_cache=False, **mm_inputs, **self._fused_kwargs(temperature))
            if self.role_spec.value_head:
                return {"values": unpack_to_padded(out, packed)}
            stats = self._token_stats(out, packed.labels, temperature, outputs)
            stats = {k: unpack_to_padded(v, packed) for k, v in stats.items()}
            if "routed_experts" in outputs:
                stats["routed_experts"] = self._recorded_routes(mb)
            return stats
        position_ids = mb["position_ids"]
        if position_ids.dim() == 3:  # mRoPE (B, C, L) -> (C, B, L), the layout Qwen-VL models take
            position_ids = position_ids.transpose(0, 1)
        out = self._module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=position_ids,
                           use_cache=False, **mm_inputs, **self._fused_kwargs(temperature))
        if self.role_spec.value_head:
            return {"values": out}
        labels = torch.roll(mb["input_ids"], shifts=-1, dims=-1)
        stats = self._token_stats(out, labels, temperature, outputs)
        if "routed_experts" in outputs:
            stats["routed_experts"] = self._recorded_routes(mb)
        return stats

    def _fused_kwargs(self, temperature: float) -> dict:
        return {"temperature": temperature, "return_dict": True} if self.use_fused_kernels else {}

    def _token_stats(self, out, labels: torch.Tensor, temperature: float, outputs: tuple[str, ...]) -> dict:
        """Log-prob of ``labels`` (the next token at every position), and entropy / sum_pi_squared where
        ``outputs`` asks for them, from model outputs."""
        if self.use_fused_kernels:
            if "sum_pi_squared" in outputs:  # validation refuses calculate_sum_pi_squared with fused kernels
                raise ValueError("sum_pi_squared needs the full logits, which use_fused_kernels never materialises")
            stats = {"log_probs": out.log_probs}
            if "entropy" in outputs:
                stats["entropy"] = out.entropy
            return stats
        logits = get_logits(out).float() / temperature  # tuple outputs (logits, ...) too
        stats = {"log_probs": verl_F.logprobs_from_logits(logits, labels)}
        if "entropy" in outputs:
            stats["entropy"] = self._entropy_fn(logits)
        if "sum_pi_squared" in outputs:  # of the temperature-scaled distribution, as the log-probs
            stats["sum_pi_squared"] = verl_F.calculate_sum_pi_squared_from_logits(logits)
        return stats

    # ------------------------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _clip_grad(self) -> float:
        """``optim.clip_grad``, or the role's legacy ``grad_clip`` where only that one was changed."""
        optim_clip = cfg_get(self.optimizer_config, "clip_grad", None)
        legacy = cfg_get(self.role_config, "grad_clip", None)
        if optim_clip is None or legacy is None or float(optim_clip) == float(legacy):
            return float(optim_clip if optim_clip is not None else (legacy if legacy is not None else 1.0))
        if float(optim_clip) == 1.0:
            return float(legacy)
        if float(legacy) == 1.0:
            return float(optim_clip)
        raise ValueError(f"optim.clip_grad={optim_clip} and grad_clip={legacy} disagree; grad_clip is the legacy "
                         "name of optim.clip_grad: set only one")

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self._module.parameters(), max_norm=self._clip_grad())
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            logger.warning("grad_norm is not finite (%s); skipping this optimizer step", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        if self.offload_optimizer:
            self.to("device", model=False, optimizer=True, grad=False)
        self.optimizer.step()
        if self.offload_optimizer:
            self.to("cpu", model=False, optimizer=True, grad=False)
        return grad_norm

    def train_batch(self, data: DataProto, loss_fn: LossFn, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        metrics = super().train_batch(data, loss_fn, outputs)
        self.optimizer_zero_grad()  # free gradient memory between mini-batches and before the rollout
        return metrics

    def lr_scheduler_step(self) -> float:
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return lr

    # ------------------------------------------------------------------------------------ weights
    def get_per_tensor_param(self, bucket_megabytes: float = 512, layered: bool = False,
                             dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights; a LoRA model's adapters are merged in (fused-expert adapters included)."""
        if self.is_lora:
            from verl.workers.lora import iter_merged_weights

            return iter_merged_weights(self._module, bucket_megabytes=bucket_megabytes, layered=layered, dtype=dtype)
        from verl.workers.weight_sync import iter_hf_weights

        return iter_hf_weights(self._module, bucket_megabytes=bucket_megabytes, layered=layered, dtype=dtype)

    def get_rollout_weights(self, bucket_megabytes: float = 512, layered: bool = False):
        if self.is_lora:
            from verl.workers.lora import lora_merge, rollout_sync

            # adapter tensors, or merged weights under model.lora.merge or where the engine cannot take the
            # adapter (logged)
            weights, kwargs = rollout_sync(self._module, bucket_megabytes=bucket_megabytes, layered=layered,
                                           merge=lora_merge(self.model_config))
        else:
            weights, kwargs = self.get_per_tensor_param(bucket_megabytes, layered), {}
        mtp = self.built.info.get("mtp") or {}
        if mtp.get("enable") and not mtp.get("rollout"):
            # The rollout drafts with the MTP head only with mtp.enable_rollout (the hf engine); else keep it out.
            # (LoRA adapter names carry PEFT's prefix before ``mtp.``.)
            weights = ((name, t) for name, t in weights if not (name.startswith("mtp.") or ".mtp." in name))
        return weights, kwargs

    # ------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: Optional[int] = None) -> None:
        self._require_checkpoints()
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)

    def load_checkpoint(self, local_path: str) -> None:
        self._require_checkpoints()
        self.checkpoint_manager.load_checkpoint(local_path)
        if self.offload_optimizer:
            self.to("cpu", model=False, optimizer=True, grad=False)

    def _require_checkpoints(self):
        if self.checkpoint_manager is None:
            raise RuntimeError(f"the {self.role} engine holds no trainable state to checkpoint")

    # ------------------------------------------------------------------------------------ memory
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        from verl.utils.fsdp_utils import move_grads, move_optimizer_state

        target = torch.device("cpu") if device == "cpu" else self.device
        if model and not self.cpu_offload_policy:  # else FSDP2's CPUOffloadPolicy owns parameter placement
            self._module.to(target)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, target)
        if grad:
            move_grads(self._module, target)
