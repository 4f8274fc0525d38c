"""``MegatronEngine``: the training-engine interface on megatron-core (TP / PP / VPP / EP / ETP, distributed
optimizer, packed THD micro-batches through the pipeline schedule).

Flow of one ``forward_backward_batch``: the batch (this DP rank's rows) is cut into micro-batches (fixed
size or token-budget balanced), each packed into one THD row with ``cu_seqlens``; megatron-core's pipeline
schedule runs them through the model chunks; on the last pipeline stage the vocab-parallel logits become
per-token log-probs / entropy without gathering the vocabulary; the role's loss function sees them in the
padded (B, L) layout. Outputs and metrics are broadcast from the last stage so every rank returns them.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.workers.engine.base import BaseEngine, LossFn, accumulate_metrics

from . import build
from .packing import next_token_labels, pack_thd, unpack_thd
from .router_replay import MegatronRouterReplay, read_mode, replay_transformer_overrides
from .settings import MegatronSettings, read_settings, require_mcore
from verl.utils.config import cfg_get

logger = logging.getLogger(__name__)

__all__ = ["MegatronEngine"]

_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def _as_output(t: torch.Tensor) -> torch.Tensor:
    return (t.float() if t.is_floating_point() else t).cpu()


class MegatronEngine(BaseEngine):
    """``engine_config`` is the role's ``megatron`` section, ``optimizer_config`` its ``optim`` section,
    ``model_config`` the ``model`` section (``path``, ``use_remove_padding`` ...)."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any = None,
                 checkpoint_config: Any = None, role: str = "actor",
                 share_module_with: Optional["MegatronEngine"] = None, **kwargs):
        require_mcore()
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, role)
        self.lora = None  # LoRA on megatron-core's linears (verl/models/mcore/lora.py): the actor's only
        if cfg_get(model_config, "lora_adapter_path", None):
            raise ValueError(f"{self.role_spec.model_section}.lora_adapter_path with strategy=megatron: starting "
                             "from a saved PEFT adapter is built on the FSDP engine only; a Megatron LoRA run resumes "
                             "from its own checkpoint (trainer.resume_mode)")
        # A frozen role (the reference) built on its own is the base model: exactly a LoRA actor's reference.
        if int(cfg_get(model_config, "lora_rank", 0) or 0) > 0 and self.role_spec.trainable:
            if self.role_spec.value_head:
                raise ValueError(f"{self.role_spec.model_section}.lora_rank > 0 with strategy=megatron: LoRA is "
                                 f"built for the Megatron actor (role {role!r} is not); set lora_rank=0 there")
            from verl.models.mcore.lora import lora_settings

            self.lora = lora_settings(model_config, seed=int(cfg_get(engine_config, "seed", 0) or 0))
        self.is_lora = self.lora is not None
        # LoRA's reference policy: the actor's own chunks with the adapters off (no second base model)
        self.share_module_with = share_module_with
        self._lora_off = False
        if self.role_spec.trainable and bool(cfg_get(cfg_get(model_config, "mtp", None) or {}, "enable", False)):
            # Config validation refuses this first; an engine built directly must not drop the head silently.
            raise ValueError(f"{self.role_spec.model_section}.mtp.enable=true: multi-token prediction is built on "
                             "the FSDP engine only here (Megatron's MTP block is not wired); use strategy=fsdp2")
        model_rp = cfg_get(model_config, "use_remove_padding", None)
        if model_rp is False:
            logger.warning("model.use_remove_padding is the deprecated alias of the engine's "
                           "megatron.use_remove_padding; packing is off for this engine")
        prefix = f"{self.role_spec.section}.megatron"
        self._prefix = prefix
        self.settings: MegatronSettings = read_settings(engine_config, model_rp, prefix=prefix)
        self.forward_only = self.settings.forward_only or not self.role_spec.trainable
        self.model: list[torch.nn.Module] = []
        self.optimizer = None
        self.lr_scheduler = None
        self._resident = {"model": True, "grad": True, "optimizer": True}
        self._hf_rollout: Optional[torch.nn.Module] = None
        self.processing_class = kwargs.get("processing_class")
        self._model_dir: Optional[str] = None
        # megatron.router_replay.mode (upstream's key): disabled, R2, R3; the actor's only (validation)
        self.router_replay_mode = read_mode(engine_config)
        if self.router_replay_mode != "disabled" and (self.role_spec.value_head or not self.role_spec.trainable):
            raise ValueError(f"{prefix}.router_replay.mode={self.router_replay_mode}: router replay is the actor's; "
                             "the reference and critic route with their own top-k")
        if self.router_replay_mode != "disabled" and self.settings.cp > 1:
            raise ValueError(f"{prefix}.router_replay.mode={self.router_replay_mode} with context_parallel_size > 1 "
                             "is not implemented (routes are laid out for whole packed rows)")
        self._replay: Optional[MegatronRouterReplay] = None

    @property
    def model_path(self) -> str:
        """``model.path`` as a local directory (a hub id is resolved through the HF cache, as the FSDP engine
        does; ``use_shm`` stages it in /dev/shm)."""
        if self._model_dir is None:  # resolved once: a hub id asks the hub (or its cache) only the first time
            from verl.utils.model_path import model_config_dir

            self._model_dir = model_config_dir(self.model_config, what=f"{self._model_section}.path")
        return self._model_dir

    @property
    def _model_section(self) -> str:
        return self.role_spec.model_section

    # ------------------------------------------------------------------ life cycle
    def initialize(self) -> None:
        from transformers import AutoConfig

        from verl.models.mcore import registry
        from verl.models.registry import apply_config_overrides
        from verl.workers.engine.external_lib import import_external_lib

        s = self.settings
        if self.share_module_with is not None:
            self._share(self.share_module_with)
            return
        timer = build.BuildTimer(f"{self._prefix} built")
        build.init_parallel_state(s)
        timer.lap("parallel state")
        import_external_lib(self.model_config)  # custom models register themselves before the config is read
        path = self.model_path  # a local directory, hub ids fetched into the HF cache
        trust = bool(cfg_get(self.model_config, "trust_remote_code", False))
        self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        # model.override_config edits the HF config the mcore config and the weight mapping are derived from,
        # exactly as on FSDP (one helper for both engines).
        apply_config_overrides(self.hf_config, cfg_get(self.model_config, "override_config", None))
        overrides = dict(s.override_transformer_config)
        for key, value in list(overrides.items()):
            if value is None:  # null = megatron-core's default (upstream's yaml lists the recompute keys so)
                overrides.pop(key)
        if "attention_backend" in overrides and isinstance(overrides["attention_backend"], str):
            import importlib.util

            from megatron.core.transformer.enums import AttnBackend

            if importlib.util.find_spec("transformer_engine") is None and overrides["attention_backend"] != "auto":
                logger.warning("override_transformer_config.attention_backend=%s picks a Transformer Engine attention "
                               "backend; without Transformer Engine the model's local attention kernel is used",
                               overrides["attention_backend"])

            overrides["attention_backend"] = AttnBackend[overrides["attention_backend"]]
        _warn_inert_extras(overrides, self.hf_config, self._prefix)
        if self.router_replay_mode != "disabled":
            overrides = replay_transformer_overrides(overrides, prefix=self._prefix)
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[s.dtype]
        self.tfconfig = registry.hf_to_mcore_config(
            self.hf_config, dtype, tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
            virtual_pipeline_model_parallel_size=s.vpp if (s.vpp or 1) > 1 else None,
            context_parallel_size=s.cp, expert_model_parallel_size=s.ep, expert_tensor_parallel_size=s.etp,
            sequence_parallel=s.sequence_parallel, **overrides)
        tie = None  # follow the checkpoint's tie_word_embeddings (its text config for VL checkpoints)
        self.forward_fn = registry.get_mcore_forward_fn(self.hf_config)
        self.converter = registry.get_mcore_weight_converter(self.hf_config)
        is_value = self.role_spec.value_head
        chunks = build.build_model_chunks(self.tfconfig, self.hf_config, registry.init_mcore_model, s, tie,
                                          value=is_value)
        timer.lap("model")
        if s.cp > 1 and not all(getattr(m, "supports_context_parallel", False) for m in chunks):
            raise ValueError(f"{self._prefix}.context_parallel_size={s.cp}: the Megatron model built for "
                             f"{type(chunks[0]).__name__} has no context-parallel attention (built for the Qwen3.5 "
                             "local spec only); set context_parallel_size=1")
        from .weights import load_initial_weights, seed_master_weights

        masters = load_initial_weights(self, chunks, path)
        if self.lora is not None:
            from .weights import apply_engine_lora

            masters = apply_engine_lora(self, chunks)
        timer.lap("weights")
        if self.forward_only:
            for m in chunks:
                m.requires_grad_(False)
                m.eval()
            self.model = chunks
        else:
            self.model = build.build_ddp(chunks, self.tfconfig, s)
            self.optimizer = build.build_optimizer(self.model, self.optimizer_config, self.tfconfig, s)
            seeded = seed_master_weights(self, masters)
            if seeded:
                logger.info("%s: %d parameters start their fp32 master weights from the checkpoint's values "
                            "(the %s parameters round them)", self._prefix, seeded, s.dtype)
            self.lr_scheduler = build.build_scheduler(self.optimizer, self.optimizer_config)
            from megatron.core.distributed import finalize_model_grads

            self.tfconfig.finalize_model_grads_func = finalize_model_grads
            no_sync = [m.no_sync for m in self.model]
            self.tfconfig.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
            self.tfconfig.grad_scale_func = None
        if self.router_replay_mode != "disabled":
            if not getattr(self.tfconfig, "num_moe_experts", None):
                raise ValueError(f"{self._prefix}.router_replay.mode={self.router_replay_mode} needs a MoE model; "
                                 f"{path} has no experts")
            self._replay = MegatronRouterReplay(self.router_replay_mode, self.model, self.tfconfig.moe_router_topk,
                                                s.sequence_parallel)
        timer.lap("optimizer" if self.optimizer is not None else "setup")
        self._offload_idle()
        timer.lap("offload")
        timer.report()

    def _share(self, other: "MegatronEngine") -> None:
        """Forward-only view of ``other``'s chunks with the adapters off (the LoRA actor's reference policy)."""
        mine, theirs = self.settings, other.settings
        layout = ("tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel")
        differ = [k for k in layout if getattr(mine, k) != getattr(theirs, k)]
        if differ:
            raise ValueError(f"{self._prefix}: with LoRA the reference policy runs on the actor's model, so its "
                             f"parallel layout must be the actor's; {differ} differ")
        for attr in ("hf_config", "tfconfig", "forward_fn", "converter", "model", "_resident"):
            setattr(self, attr, getattr(other, attr))
        self.forward_only = True
        self._lora_off = True

    # ------------------------------------------------------------------ modes / memory
    @contextmanager
    def train_mode(self):
        # With optimizer_offload the Adam state comes in only around the step (optimizer_step): resident through
        # forward/backward it added ~15 GB per GPU at the 35B-A3B shape and ran step 2 out of memory.
        self.to("device", model=True, optimizer=not self.settings.optimizer_offload, grad=True)
        for m in self.model:
            m.train()
        try:
            yield
        finally:
            self._offload_idle()

    @contextmanager
    def eval_mode(self):
        self.to("device", model=True, optimizer=False, grad=False)
        for m in self.model:
            m.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self._offload_idle()

    def _offload_idle(self) -> None:
        s = self.settings
        self.to("cpu", model=s.param_offload, optimizer=s.optimizer_offload, grad=s.grad_offload)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        from verl.utils import megatron_utils as mu

        on_gpu = device != "cpu"
        grad = grad and not self.forward_only
        optimizer = optimizer and self.optimizer is not None
        want_model = model and self._resident["model"] != on_gpu
        want_grad = grad and self._resident["grad"] != on_gpu
        if on_gpu:
            if want_model or want_grad:
                mu.load_megatron_model_to_gpu(self.model, load_grad=want_grad, load_params=want_model)
            if optimizer and not self._resident["optimizer"]:
                mu.load_megatron_optimizer(self.optimizer)
        else:
            if optimizer and self._resident["optimizer"]:
                mu.offload_megatron_optimizer(self.optimizer)
            if want_model or want_grad:
                mu.offload_megatron_model_to_cpu(self.model, offload_params=want_model, offload_grads=want_grad)
        if want_model:
            self._resident["model"] = on_gpu
        if want_grad:
            self._resident["grad"] = on_gpu
        if optimizer:
            self._resident["optimizer"] = on_gpu

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)

    @property
    def module(self):
        return self.model

    def model_hf_config(self):
        return self.hf_config  # the mcore chunks carry a TransformerConfig, not the HF config

    # ------------------------------------------------------------------ compute
    def _micro_batches(self, data: DataProto, meta: dict, keys: list[str]):
        from verl.utils.seqlen_balancing import rearrange_micro_batches

        device = torch.device("cuda", torch.cuda.current_device())
        batch = data.batch.select(*keys)
        pp, vpp = self.settings.pp, (self.settings.vpp or 1)
        if meta.get("use_dynamic_bsz", False):
            # The budget is per GPU (upstream's *_max_token_len_per_gpu): a micro-batch is spread over the CP ranks.
            budget = int(meta["max_token_len"]) * self.settings.cp
            key = {"budget_key": meta["max_token_len_key"]} if meta.get("max_token_len_key") else {}
            tds, groups = rearrange_micro_batches(batch, max_token_len=budget, dp_group=self.dp_group,
                                                  num_batches_divided_by=pp if vpp > 1 else None, **key)
        else:
            size = int(meta.get("micro_batch_size") or len(data))
            n = len(data)
            groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
            tds = [batch[g[0]: g[-1] + 1] for g in groups]
        if vpp > 1 and len(tds) % pp:
            raise ValueError(f"interleaved pipeline schedules need the number of micro-batches ({len(tds)}) to be a "
                             f"multiple of pipeline_model_parallel_size ({pp}); change the micro-batch size")
        return [{k: td[k].to(device) for k in td.keys()} for td in tds], groups

    def _global_batch_info(self, data: DataProto) -> dict:
        mask = data.batch["response_mask"] if "response_mask" in data.batch.keys() else data.batch["attention_mask"]
        counts = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64,
                              device=torch.device("cuda", torch.cuda.current_device()))
        if self.dp_size > 1:
            dist.all_reduce(counts, group=self.dp_group)
        return {"dp_size": self.dp_size, "batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item()}

    def forward_backward_batch(self, data: DataProto, loss_fn: Optional[LossFn] = None,
                               forward_only: bool = False, outputs: tuple[str, ...] = ("log_probs",)) -> dict:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_only = forward_only or loss_fn is None or self.forward_only
        meta = data.meta_info
        temperature = float(meta.get("temperature", 1.0))
        keys = [k for k in data.batch.keys()]
        micro, groups = self._micro_batches(data, meta, keys)
        global_info = None if loss_fn is None else self._global_batch_info(data)
        n_micro = len(micro)
        want = set(outputs)
        if "sum_pi_squared" in want:  # validation refuses actor.calculate_sum_pi_squared with strategy=megatron
            raise ValueError("sum_pi_squared is not computed by the Megatron engine here; use the FSDP engine")
        if loss_fn is not None and not self.role_spec.value_head:
            want.add("log_probs")
        collected: list[tuple[int, dict]] = []
        metrics: list[dict] = []

        def loss_func(mb: dict, packed, index: int, output: torch.Tensor):
            outs = self._token_outputs(output, packed)
            collected.append((index, {k: v.detach() for k, v in outs.items()}))
            if loss_fn is None:  # forward only: the schedule still wants a scalar "loss"
                return torch.zeros((), device=torch.device("cuda", torch.cuda.current_device())), {}
            mb = dict(mb)
            mb["global_batch_info"] = global_info
            loss, m = loss_fn(outs, mb)
            metrics.append({k: float(v) for k, v in m.items()})
            # The schedule divides by the number of micro-batches and multiplies by the CP size; the role's loss
            # is already normalised by global counts, so undo the division. The CP factor stays: every CP rank
            # computes the same full loss (its outputs are gathered) and back-propagates only through its own
            # tokens, so the ranks' gradients sum to the loss's; DDP averages over data x context parallel ranks,
            # and the factor cp turns that average back into the data-parallel mean, as at CP=1.
            return loss * n_micro, {}

        replay = self._replay
        if "routed_experts" in want and replay is None:
            raise ValueError("routed_experts requested from an engine without megatron.router_replay.mode")
        record = "routed_experts" in want  # R2's old-log-prob pass records; any other pass replays the batch's

        def forward_step(data_iterator, model):
            index = next(data_iterator)  # every model chunk walks the micro-batches in order
            mb = micro[index]
            packed = self._pack(mb)
            if replay is not None:
                replay.before_forward(model, index, mb, packed, record)
            output = self._model_forward(model, mb, packed, temperature, want)
            if replay is not None:
                output = replay.after_forward(model, index, output, record, forward_only)
            return output, partial(loss_func, mb, packed, index)

        single = len(self.model) == 1
        feed = iter(range(n_micro)) if single else [iter(range(n_micro)) for _ in self.model]
        if self.settings.use_remove_padding:
            max_len = max(int(mb["attention_mask"].sum()) for mb in micro)
        else:
            max_len = max(int(mb["input_ids"].size(-1)) for mb in micro)
        if replay is not None:
            replay.begin_batch()
        adapters = self._adapter_context()
        try:
            with adapters:
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=feed,
                    model=self.model[0] if single else self.model, num_microbatches=n_micro, seq_length=max_len,
                    micro_batch_size=1, forward_only=forward_only)
            if record:  # collective: every rank takes part, the last stage keeps them with its outputs
                routes = replay.recorded_routes(micro)
                for index, outs in collected:
                    outs["routed_experts"] = routes[index]
        finally:
            if replay is not None:
                replay.end_batch()
        result = self._assemble(collected, groups, want)
        summed = getattr(loss_fn, "summed_metrics", ())
        return self._broadcast_from_last_stage({"outputs": result, "metrics": accumulate_metrics(metrics, summed)})

    def _adapter_context(self):
        if not self._lora_off:
            return contextlib.nullcontext()
        from verl.models.mcore.lora import lora_disabled

        return lora_disabled(self.model)

    def _pack(self, mb: dict):
        """The micro-batch as one THD row (None without remove-padding); under sequence parallelism its length
        is a multiple of the TP size."""
        s = self.settings
        if not s.use_remove_padding:
            return None
        return pack_thd(mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                        align=s.tp if s.sequence_parallel else 1, cp=s.cp)

    def _model_forward(self, model, mb: dict, packed, temperature: float, want: set):
        """One micro-batch (``packed`` by :meth:`_pack`) through one model chunk. On the last stage a policy
        returns {"log_probs", "entropy"?} per token (the model's forward computes them from the final hidden
        states a chunk of tokens at a time, reducing the softmax over the TP ranks: the vocabulary is never
        gathered), a value model its values; other stages return hidden states for the next one."""
        s = self.settings
        kw = {}
        if not self.role_spec.value_head:  # the LM head computes log-probs (and entropy) from the labels
            kw = dict(temperature=temperature, calculate_entropy="entropy" in want, chunk_size=s.entropy_chunk_size)
        if packed is not None:
            ids, pos, labels = packed.input_ids, packed.position_ids, packed.labels
            if s.cp > 1:  # this CP rank's two chunks of every sequence; the params keep the global boundaries
                shard = self._cp_shard(packed)
                ids, pos, labels = shard.shard(ids), shard.shard(pos), shard.shard(labels)
            if not self.role_spec.value_head:
                kw["labels"] = labels
            return self.forward_fn(model, ids, pos, packed_seq_params=packed.packed_seq_params(), **kw)
        position_ids = mb["position_ids"]
        if position_ids.dim() == 3:  # (B, C, L) mRoPE -> (C, B, L)
            position_ids = position_ids.transpose(0, 1)
        if not self.role_spec.value_head:
            kw["labels"] = next_token_labels(mb["input_ids"], mb["attention_mask"])
        return self.forward_fn(model, mb["input_ids"], position_ids, packed_seq_params=None,
                               attention_mask=mb["attention_mask"], **kw)

    def _cp_shard(self, packed):
        """The context-parallel layout of a packed micro-batch (kept on it: the loss side reuses it)."""
        from megatron.core import parallel_state as ps

        from verl.models.mcore.context_parallel import CPShard

        if getattr(packed, "cp_shard", None) is None:
            packed.cp_shard = CPShard.build(packed.cu_seqlens, self.settings.cp, ps.get_context_parallel_rank())
        return packed.cp_shard

    def _token_outputs(self, output, packed) -> dict:
        """Last-stage output of one micro-batch -> {name: (B, L) next-token-aligned float tensor}. Under context
        parallelism the rank's per-token outputs are first gathered into the full row (every CP rank then
        holds the same outputs and computes the same loss; see loss_func)."""
        if self.role_spec.value_head:
            output = {"values": output}
        out = {}
        for name, value in output.items():
            value = value.float()
            if packed is not None and self.settings.cp > 1:
                from megatron.core import parallel_state as ps

                from verl.models.mcore.context_parallel import gather_to_full

                value = gather_to_full(value, self._cp_shard(packed), ps.get_context_parallel_group(), dim=-1)
            out[name] = unpack_thd(value, packed) if packed is not None else value
        return out

    def _assemble(self, collected, groups, want: set) -> dict:
        if not collected:
            return {}
        collected.sort(key=lambda x: x[0])
        names = [k for k in collected[0][1] if k in want or k == "values"]
        order = [i for g in groups for i in g]
        restore = torch.empty(len(order), dtype=torch.long)
        restore[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        # floats as fp32; R2's recorded routes keep their integer dtype
        return {k: _as_output(torch.cat([c[1][k] for c in collected], dim=0))[restore] for k in names}

    def _broadcast_from_last_stage(self, result: dict) -> dict:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return result
        group = ps.get_pipeline_model_parallel_group()
        src = ps.get_pipeline_model_parallel_last_rank()
        box = [result if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _grads_finite(self) -> bool:
        from verl.utils.megatron_utils import ddp_buffers

        ok = torch.ones((), device=torch.device("cuda", torch.cuda.current_device()))
        for m in self.model:
            for buf in ddp_buffers(m):
                if buf.grad_data is not None and buf.grad_data.numel() and not torch.isfinite(buf.grad_data).all():
                    ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def optimizer_step(self) -> float:
        if not self._grads_finite():
            logger.warning("gradients are not finite; skipping this optimizer step")
            self.optimizer_zero_grad()
            return float("nan")
        offload = self.settings.optimizer_offload
        if offload:
            self.to("device", model=False, optimizer=True, grad=False)
        try:
            _ok, grad_norm, _zeros = self.optimizer.step()
        finally:
            if offload:
                self.to("cpu", model=False, optimizer=True, grad=False)
        return float(grad_norm) if grad_norm is not None else float("nan")

    def lr_scheduler_step(self) -> float:
        lr = self.current_lr()
        self.lr_scheduler.step(increment=1)
        return lr

    def current_lr(self) -> float:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else 0.0

    # ------------------------------------------------------------------ weights / checkpoints
    def get_per_tensor_param(self, bucket_megabytes: float = 512, layered: bool = False
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors (collective); offloaded weights come back for the walk and leave after it."""
        from .weights import iter_hf_weights

        self.to("device", model=True, optimizer=False, grad=False)

        def walk():
            try:
                yield from iter_hf_weights(self, bucket_megabytes=bucket_megabytes)
            finally:
                self._offload_idle()

        return walk()

    def hf_rollout_module(self) -> torch.nn.Module:
        """The HF module the ``hf`` rollout generates with: an HF copy of the policy (the Megatron chunks
        cannot ``generate``), built once and kept current by :meth:`sync_hf_rollout_module`."""
        from .weights import build_hf_module, sync_hf_module

        if self._hf_rollout is None:
            timer = build.BuildTimer(f"{self._prefix}: the hf rollout's copy built")
            self._hf_rollout = build_hf_module(self)
            timer.lap("module")
            sync_hf_module(self, self._hf_rollout)  # fills every parameter (it may start from a dist checkpoint)
            timer.lap("sync")
            timer.report()
        return self._hf_rollout

    def sync_hf_rollout_module(self) -> None:
        """Refresh the hf rollout's copy after an update or a checkpoint load (collective); a released copy gets
        its memory back first."""
        from .weights import restore_hf_module, sync_hf_module

        if self._hf_rollout is not None:
            restore_hf_module(self._hf_rollout)
            sync_hf_module(self, self._hf_rollout)

    def release_hf_rollout_module(self) -> bool:
        """Free the copy's parameter memory (the contents are discarded: the sync before the next generation
        rewrites every parameter, :func:`~.weights.sync_hf_module` proves it). At the 35B-A3B shape on 4 GPUs
        that is 1.7 GB per layer per GPU that the old log-prob, reference and update passes get back."""
        from .weights import release_hf_module

        return self._hf_rollout is not None and release_hf_module(self._hf_rollout)

    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: Optional[int] = None) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(self, local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path: str) -> None:
        from .checkpoint import load_checkpoint

        load_checkpoint(self, local_path)


def _warn_inert_extras(overrides: dict, hf_config, prefix: str) -> None:
    """MindSpeed keys of upstream's Qwen3.5 scripts that are accepted but change nothing for this model: said once
    per engine, never silently (config_fields.APPLIED_EXTRAS)."""
    from verl.models.spec import get_model_spec

    key = f"{prefix}.override_transformer_config"
    if overrides.get("use_flash_attn"):
        logger.warning("%s.use_flash_attn=true changes nothing here: packed full attention already runs a varlen "
                       "flash kernel on CUDA in bf16/fp16 (flash-attn's or torch's; MindSpeed's switch is for Ascend)",
                       key)
    if overrides.get("use_naive_l2norm") and not get_model_spec(hf_config).has_linear_attention:
        logger.warning("%s.use_naive_l2norm=true changes nothing for %s: it has no Gated DeltaNet layers", key,
                       type(hf_config).__name__)
