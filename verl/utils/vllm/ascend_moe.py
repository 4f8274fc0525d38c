"""vLLM-Ascend routed-expert layouts and the rules for syncing them (importable without an NPU).

vLLM-Ascend runs MoE through NPU grouped matmul, so after loading it *post-processes* expert weights into a
runtime layout, transposing each expert matrix:

=========== ================================ ================================
tensor      checkpoint layout (before)       runtime layout (after)
=========== ================================ ================================
w13_weight  [E_local, 2 * I_tp, H]           [E_local, H, 2 * I_tp]
w2_weight   [E_local, H, I_tp]               [E_local, I_tp, H]
=========== ================================ ================================

Two sync paths follow, and mixing them corrupts the layout silently (the first rollout then fails in
``npu_grouped_matmul`` with a hidden-size mismatch, or worse, runs with transposed experts):

* colocated FSDP2 sync (:func:`write_runtime_experts`): the trainer's fused HF experts are written straight
  into the runtime layout; post-processing must then be *skipped* — running it again would transpose the
  freshly written tensors back (:class:`PostLoadGuard`).
* full reload (server mode, or any path through the engine's checkpoint loader): tensors arrive in checkpoint
  layout (:func:`to_checkpoint_layout` restores the parameter first) and post-processing must run again.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

NZ_ENV = "VLLM_ASCEND_ENABLE_NZ"
RUNTIME = "runtime"
CHECKPOINT = "checkpoint"


def require_nz_disabled(environ: Optional[dict] = None) -> None:
    """Weights in the NPU's FRACTAL_NZ format cannot be re-filled after sleep; insist on ND (NZ off)."""
    env = os.environ if environ is None else environ
    value = env.get(NZ_ENV)
    if value != "0":
        raise RuntimeError(
            f"{NZ_ENV}={value!r}: vLLM-Ascend keeps weights in the NZ format, which the rollout cannot refill "
            f"after sleep/wake-up or a weight sync. Export {NZ_ENV}=0 before starting the workers."
        )


def shard_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_ids: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF fused experts -> this rank's slice, still in checkpoint layout.

    ``gate_up`` [E, 2I, H] (gate rows then up rows), ``down`` [E, H, I]. Tensor parallelism splits I (each
    rank keeps its gate slice and its up slice, stacked gate-then-up); expert parallelism keeps
    ``expert_ids``. Returns w13 [E_local, 2*I_tp, H] and w2 [E_local, H, I_tp].
    """
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"expected 3-D fused experts, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    inter = gate_up.shape[1] // 2
    if inter % tp_size:
        raise ValueError(f"moe intermediate size {inter} is not divisible by tensor parallel size {tp_size}")
    if expert_ids is not None:
        idx = torch.as_tensor(expert_ids, dtype=torch.long, device=gate_up.device)
        gate_up, down = gate_up.index_select(0, idx), down.index_select(0, idx)
    part = inter // tp_size
    lo, hi = tp_rank * part, (tp_rank + 1) * part
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    w13 = torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=1)
    w2 = down[:, :, lo:hi]
    return w13, w2


def to_runtime_layout(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint -> runtime layout (what post-processing does)."""
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def layout_of(layer, hidden_size: int) -> str:
    """Which layout the layer's expert parameters are in now, read from their shapes."""
    w13 = layer.w13_weight
    if w13.shape[1] == hidden_size and w13.shape[2] != hidden_size:
        return RUNTIME
    if w13.shape[2] == hidden_size and w13.shape[1] != hidden_size:
        return CHECKPOINT
    # 2*I_tp == H: shapes cannot tell; trust the recorded state.
    return getattr(layer, "_verl_moe_layout", CHECKPOINT)


def write_runtime_experts(
    layer,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    hidden_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_ids: Optional[list[int]] = None,
) -> None:
    """Colocated sync: copy the trainer's fused experts into the layer's runtime-layout parameters in place.

    The layer must already be post-processed (runtime layout); the layer is marked so that
    :class:`PostLoadGuard` does not post-process it a second time.
    """
    if layout_of(layer, hidden_size) != RUNTIME:
        raise RuntimeError(
            "write_runtime_experts expects post-processed (runtime-layout) expert weights "
            f"w13 [E, H={hidden_size}, 2I]; got w13 {tuple(layer.w13_weight.shape)}. Use the checkpoint "
            "loader path (full reload + post-processing) for layers that were never post-processed."
        )
    w13, w2 = to_runtime_layout(*shard_experts(gate_up, down, tp_rank, tp_size, expert_ids))
    for pname, value in (("w13_weight", w13), ("w2_weight", w2)):
        param = getattr(layer, pname)
        if tuple(param.shape) != tuple(value.shape):
            raise RuntimeError(
                f"{pname}: runtime layout expects {tuple(param.shape)}, the synced tensor is {tuple(value.shape)} "
                "(check tensor/expert parallel sizes against the trainer's expert shapes)"
            )
        param.data.copy_(value.to(dtype=param.dtype, device=param.device))
    layer._verl_moe_layout = RUNTIME
    layer._verl_skip_post_process = True


def to_checkpoint_layout(layer, hidden_size: int) -> bool:
    """Full-reload path: put runtime-layout parameters back to checkpoint layout so the engine's loader can
    write checkpoint shards; post-processing must follow. Returns whether a transpose was needed."""
    if layout_of(layer, hidden_size) != RUNTIME:
        return False
    for pname in ("w13_weight", "w2_weight"):
        param = getattr(layer, pname)
        param.data = param.data.transpose(1, 2).contiguous()
    layer._verl_moe_layout = CHECKPOINT
    layer._verl_skip_post_process = False
    return True


class PostLoadGuard:
    """Decides, per MoE layer, whether the engine's post-load processing runs after a sync.

    ``mode="colocated"``: layers written by :func:`write_runtime_experts` skip it (already runtime layout).
    ``mode="reload"``: every layer is post-processed again (server-mode full reload, checkpoint layout).
    LoRA adapter syncs never reach here: adapters do not touch expert base weights.
    """

    def __init__(self, mode: str):
        if mode not in ("colocated", "reload"):
            raise ValueError(f"mode must be 'colocated' or 'reload', got {mode!r}")
        self.mode = mode

    def after_load(self, layers, post_process: Callable[[object], None]) -> int:
        """Run ``post_process(layer)`` where needed; returns how many layers were processed."""
        done = 0
        for layer in layers:
            skip = self.mode == "colocated" and getattr(layer, "_verl_skip_post_process", False)
            layer._verl_skip_post_process = False
            if skip:
                continue
            post_process(layer)
            layer._verl_moe_layout = RUNTIME
            done += 1
        return done


class RuntimeExpertWriter:
    """Colocated FSDP2 sync on vLLM-Ascend: intercepts HF fused expert tensors from the weight stream and
    writes them into the engine's post-processed MoE layers directly (:func:`write_runtime_experts`).

    ``offer(name, tensor)`` returns True when it took the tensor (the caller then keeps it away from the
    checkpoint loader); a layer is written once both its ``gate_up_proj`` and ``down_proj`` arrived.
    """

    def __init__(self, model, hidden_size: int, tp_rank: int = 0, tp_size: int = 1, experts_path: str = "experts"):
        self.model = model
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.experts_path = experts_path
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self.layers: list = []
        self.param_names: list[str] = []  # engine parameters written (they bypass the loader's report)
        self._deferred: list = []

    def _engine_module(self, hf_prefix: str):
        # HF "...mlp.experts" -> engine "...mlp.<experts_path>"; VL checkpoints nest the text model.
        name = hf_prefix[: -len("experts")] + self.experts_path
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model.") :]
        self.param_names += [f"{name}.w13_weight", f"{name}.w2_weight"]
        return self.model.get_submodule(name)

    def offer(self, name: str, tensor: torch.Tensor) -> bool:
        for leaf in ("gate_up_proj", "down_proj"):
            if name.endswith(".mlp.experts." + leaf):
                prefix = name[: -len(leaf) - 1]
                parts = self._pending.setdefault(prefix, {})
                parts[leaf] = tensor
                if len(parts) == 2:
                    layer = self._engine_module(prefix)
                    if layer.w13_weight.is_meta:
                        # Inside a layerwise reload the layer sits on the meta device until the reload puts its
                        # kernel tensors back: write it then (finish()), or the write would be lost.
                        self._deferred.append((layer, parts))
                    else:
                        self._write(layer, parts)
                    del self._pending[prefix]
                return True
        return False

    def _write(self, layer, parts: dict) -> None:
        expert_map = getattr(layer, "expert_map", None)
        ids = None
        if expert_map is not None:  # expert parallel: global ids this rank owns, in local order
            ids = [int(g) for g in torch.argsort(expert_map)[(expert_map < 0).sum() :]]
        write_runtime_experts(
            layer, parts["gate_up_proj"], parts["down_proj"], self.hidden_size, self.tp_rank, self.tp_size, ids
        )
        self.layers.append(layer)

    def finish(self) -> None:
        if self._pending:
            raise RuntimeError(f"expert tensors arrived incomplete for: {sorted(self._pending)}")
        deferred, self._deferred = self._deferred, []
        for layer, parts in deferred:
            self._write(layer, parts)
