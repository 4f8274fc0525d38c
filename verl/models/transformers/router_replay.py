"""MoE router replay for transformers' top-k routers: record the experts each token was sent to, or force them.

The routers this targets (``Qwen3_5MoeTopKRouter`` and its Qwen3 / Qwen3-Next siblings in transformers 5) take
the flattened hidden states ``(T, H)`` and return ``(router_logits, routing_weights, expert_indices)``: a
softmax over all experts, its top-k indices, and the top-k probabilities renormalised to sum to one. A forward
hook on each router sees that output and

* ``record``: hands the indices ``(T, k)`` of MoE layer ``li`` to a sink (the rollout writes them into its slot
  buffer; the trainer keeps them as the R2 routes);
* ``replay``: replaces indices and weights by the given routes ``(T, n_moe_layers, k)``: the softmax is the
  router's own (so gradients still reach the router weights through the probabilities of the chosen experts),
  the weights are those probabilities renormalised exactly as the normal top-k path does. A token whose routes
  are negative (a padding token, or the last response token the rollout never fed back) keeps its own top-k.

Layers are numbered in module order (the decoder's order), counting only MoE layers: upstream's
``routed_experts`` layout ``(tokens, moe_layers, top_k)``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch


def is_topk_router(module: torch.nn.Module) -> bool:
    """A router with the ``(logits, weights, indices)`` contract above (transformers' ``*TopKRouter``)."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "weight")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_topk_router(m)]


def routes_shape(model: torch.nn.Module) -> Optional[tuple[int, int]]:
    """``(n_moe_layers, top_k)`` of ``model``, or None for a dense model."""
    routers = moe_routers(model)
    if not routers:
        return None
    return len(routers), int(routers[0].top_k)


def replay_topk(router_logits: torch.Tensor, own_indices: torch.Tensor, routes: torch.Tensor):
    """``(weights, indices)`` routing each token to ``routes`` (T, k) instead of its own top-k; rows with a
    negative route keep ``own_indices``. Weights: the softmax over all experts (fp32, as the router computes
    it) at the chosen experts, divided by their sum, cast back to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    given = (routes >= 0).all(dim=-1, keepdim=True)
    indices = torch.where(given, routes.to(own_indices.dtype), own_indices)
    top = probs.gather(-1, indices)
    top = top / top.sum(dim=-1, keepdim=True)
    return top.to(router_logits.dtype), indices


class RouterTape:
    """Hooks on every top-k router of a model; ``mode`` is ``None`` (pass through), ``record`` or ``replay``.

    record: ``sink(li, indices)`` is called for MoE layer ``li`` (default sink: keep the latest indices per
    layer in ``recorded``; a recomputation under activation checkpointing overwrites with the same values).
    replay: ``routes`` (T, n_moe_layers, k) must be set, T = the tokens of the forward in flattened order (or
    a tuple of such tensors for different T: each router takes the one whose T matches its input).
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.mode: Optional[str] = None
        self.routes: Optional[torch.Tensor] = None
        self.sink: Optional[Callable[[int, torch.Tensor], None]] = None
        self.recorded: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook(li)) for li, r in enumerate(self.routers)]

    @property
    def shape(self) -> Optional[tuple[int, int]]:
        return (len(self.routers), int(self.routers[0].top_k)) if self.routers else None

    def _hook(self, li: int):
        def hook(module, args, output):
            if self.mode is None:
                return None
            logits, weights, indices = output
            if self.mode == "record":
                if self.sink is not None:
                    self.sink(li, indices)
                else:
                    self.recorded[li] = indices.detach()
                return None
            if self.mode == "replay":
                # several layouts may be given (the padded batch's real tokens, or all B*L of them: a forward
                # that packs a padded batch itself routes only the real ones); the one with the router's count
                routes = next((r for r in self.routes if r.shape[0] == indices.shape[0]), self.routes[0])[:, li]
                if routes.shape != indices.shape:
                    raise ValueError(f"router replay: routes for {tuple(routes.shape)} (tokens, top_k) but the "
                                     f"router of MoE layer {li} saw {tuple(indices.shape)}")
                new_weights, new_indices = replay_topk(logits, indices, routes.to(indices.device))
                return logits, new_weights, new_indices
            raise ValueError(f"router replay mode {self.mode!r}")

        return hook

    def stacked(self) -> torch.Tensor:
        """The recorded routes as (T, n_moe_layers, k)."""
        missing = [li for li in range(len(self.routers)) if li not in self.recorded]
        if missing:
            raise RuntimeError(f"router replay: no routes recorded for MoE layers {missing}")
        return torch.stack([self.recorded[li] for li in range(len(self.routers))], dim=1)

    @contextlib.contextmanager
    def recording(self, sink: Optional[Callable] = None):
        self.mode, self.sink, self.recorded = "record", sink, {}
        try:
            yield self
        finally:
            self.mode, self.sink = None, None

    @contextlib.contextmanager
    def replaying(self, routes):
        self.mode, self.routes = "replay", tuple(routes) if isinstance(routes, (tuple, list)) else (routes,)
        try:
            yield self
        finally:
            self.mode, self.routes = None, None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
