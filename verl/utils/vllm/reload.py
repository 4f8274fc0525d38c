"""What a vLLM in-place weight reload reports, and what it leaves stale (pure torch; no vLLM import).

vLLM's layerwise reload (``worker.reload_weights(..., is_checkpoint_format=True)``) re-runs each layer's
post-load processing only for layers that *received* weights. A layer whose parameter is an alias of another
layer's (a tied LM head shares ``embed_tokens.weight``) receives nothing, so whatever its processing derived
from the old weights survives the reload: on the CPU build the LM head keeps a pre-packed GEMM copy of the
old embedding, and the engine scores with it (measured: log-prob gap 1.87 to the trainer after one step,
while a fresh engine from the same weights matched). :func:`refresh_aliased_layers` re-processes every layer
that shares a parameter with another one after each full reload.

:class:`LoadedNames` collects the parameter names the model's own ``load_weights`` reports as loaded, so the
coverage check uses the engine's word rather than a name mapping of ours.
"""

from __future__ import annotations

import contextlib

import functools
import logging
from collections import defaultdict
from typing import Callable, Optional

from torch import nn

logger = logging.getLogger(__name__)


def aliased_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> module, for every module holding a parameter object that another module also holds."""
    holders: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for path, module in model.named_modules():
        for _, param in module.named_parameters(recurse=False):
            holders[id(param)].append((path, module))
    out: dict[str, nn.Module] = {}
    for group in holders.values():
        if len({id(m) for _, m in group}) > 1:
            out.update(group)
    return out


def refresh_aliased_layers(model: nn.Module, process: Optional[Callable[[nn.Module], None]] = None) -> list[str]:
    """Re-run post-load processing on every layer that shares a parameter (tied heads); returns their paths.

    ``process(layer)`` defaults to ``layer.quant_method.process_weights_after_loading(layer)`` (vLLM's hook
    that, e.g., packs a CPU GEMM weight); layers without a ``quant_method`` hold no derived state to refresh.
    """
    done = []
    for path, layer in aliased_layers(model).items():
        if process is not None:
            process(layer)
        else:
            method = getattr(layer, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            method.process_weights_after_loading(layer)
        done.append(path)
    if done:
        logger.debug("re-processed aliased layers after reload: %s", done)
    return done


def _cpu_experts_class():
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # no vLLM, or a build without the CPU MoE kernels
        return None
    return CPUUnquantizedExperts


def repack_cpu_moe_experts(model: nn.Module) -> list[str]:
    """Re-pack routed experts for vLLM's CPU MoE kernel after an in-place reload; returns the layer paths.

    vLLM's CPU experts keep ``w13_weight`` / ``w2_weight`` in a pre-packed grouped-GEMM layout made by the
    kernel's own ``process_weights_after_loading``, which vLLM runs only when the kernel is first built: on a
    weight update it rewrites the parameters in checkpoint layout and skips the pack, so the kernel then reads
    unpacked weights (measured: every expert tensor off by up to 0.12 from a fresh engine's, log-prob gap 0.09
    to the trainer). Packing the freshly loaded weights here restores what a fresh engine holds. GPU backends
    keep no such layout and are not touched.
    """
    cpu_experts = _cpu_experts_class()
    if cpu_experts is None:
        return []
    done = []
    for path, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, cpu_experts):
            experts.process_weights_after_loading(layer)
            done.append(path)
    return done


def lora_base_layer_renamer(model: nn.Module) -> Optional[Callable[[str], str]]:
    """Checkpoint name -> the name a reload must use in an engine whose layers vLLM wrapped for LoRA, or None
    where nothing is wrapped.

    With LoRA enabled, vLLM replaces each adaptable linear layer ``X`` by a wrapper holding the original as
    ``X.base_layer``, after the initial load; a later reload in checkpoint format (a full sync, merged LoRA)
    then names ``X.weight``, which the wrapped model no longer has (seen on vLLM 0.26 CUDA: "no module or
    parameter named 'layers.0.linear_attn.conv1d.weight' ... are: {'...conv1d.base_layer.weight'}"). A
    checkpoint leaf that the model packs into a fused layer (``q_proj`` into ``qkv_proj``, per the model's
    ``packed_modules_mapping``) follows that fused layer.
    """
    wrapped = {path for path, m in model.named_modules() if isinstance(getattr(m, "base_layer", None), nn.Module)}
    if not wrapped:
        return None
    packed = getattr(model, "packed_modules_mapping", None) or {}
    fused_of = {leaf: fused for fused, leaves in packed.items() for leaf in leaves}

    def rename(name: str) -> str:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        target = module if module in wrapped else f"{parent}.{fused_of.get(leaf, leaf)}"
        return f"{module}.base_layer.{param}" if target in wrapped else name

    return rename


@contextlib.contextmanager
def routed_experts_without_lora_prefix(model: nn.Module):
    """Within the block, vLLM's routed-experts modules map checkpoint names as if LoRA had not wrapped them.

    vLLM 0.26's ``FusedMoEWithLoRA`` sets ``routed_experts.lora_base_layer_prefix = "base_layer."`` on the layer
    it wraps, and ``RoutedExperts.load_weights`` builds its name mapping with that prefix but then looks the
    result up on itself (``getattr(self, "base_layer.w13_weight")``), which no module has: every reload of a
    LoRA-enabled MoE engine failed there (seen on an H100). The experts the reload reaches are the routed
    experts themselves, so the prefix-free mapping is the right one for them; it is restored afterwards.
    """
    touched = [m for m in model.modules() if getattr(m, "lora_base_layer_prefix", "")]
    saved = [m.lora_base_layer_prefix for m in touched]
    for m in touched:
        m.lora_base_layer_prefix = ""
    try:
        yield len(touched)
    finally:
        for m, prefix in zip(touched, saved):
            m.lora_base_layer_prefix = prefix


def resolve_delegated_names(reported: set[str], param_names: set[str]) -> set[str]:
    """``reported`` with each name that is no parameter of the engine replaced by the one parameter it stands
    for, where a module loaded its weights through a child and reported them relative to itself.

    vLLM 0.26's fused-MoE layer delegates to its ``routed_experts`` child, which loads ``w13_weight`` /
    ``w2_weight`` (fused or per-expert checkpoint tensors alike) and reports them as ``<layer>.experts.w13_weight``
    although the parameters are ``<layer>.experts.routed_experts.w13_weight`` (vLLM's own reload then warns
    they were not loaded). Only an exact one-segment gap with a single candidate counts; anything else stays
    unresolved, so a weight that was really skipped still fails the coverage check.
    """
    by_gap: dict[str, list[str]] = defaultdict(list)
    for name in param_names:
        parent, _, leaf = name.rpartition(".")
        grand, _, _child = parent.rpartition(".")
        if grand:
            by_gap[f"{grand}.{leaf}"].append(name)
    out = set()
    for name in reported:
        candidates = by_gap.get(name, []) if name not in param_names else []
        out.add(candidates[0] if len(candidates) == 1 else name)
    return out


class LoadedNames:
    """``with LoadedNames(model) as loaded:`` — ``loaded.names`` is the union of what every
    ``model.load_weights(...)`` call inside the block returned (vLLM models return the set of parameter names
    they loaded); ``loaded.reported`` is False when the loader returned nothing usable.

    ``loader``: a registered custom loader ``(actor_weights: dict, model) -> model`` (see
    :mod:`verl.models.dtensor_weight_loader`) that runs *instead of* the model's own ``load_weights``; the
    names it loaded are those whose ``param.weight_loader`` it called.
    """

    def __init__(self, model: nn.Module, loader: Optional[Callable] = None):
        self.model = model
        self.loader = loader
        self.names: set[str] = set()
        self.reported = False

    def _custom_load(self, weights) -> set[str]:
        called: set[str] = set()
        wrapped = []
        for name, param in self.model.named_parameters():
            inner = getattr(param, "weight_loader", None)
            if inner is None:
                continue

            # wraps(): vLLM's layerwise reload recognises its own loader wrappers by name and unwraps them
            # through __wrapped__, so the recorder must look like the loader it wraps.
            @functools.wraps(inner)
            def record(*args, _inner=inner, _name=name, **kwargs):
                called.add(_name)
                return _inner(*args, **kwargs)

            param.weight_loader = record
            wrapped.append((param, inner))
        try:
            self.loader(dict(weights), self.model)
        finally:
            for param, inner in wrapped:
                param.weight_loader = inner
        return called

    def __enter__(self) -> "LoadedNames":
        original = self._custom_load if self.loader is not None else self.model.load_weights

        def load_weights(weights, *args, **kwargs):
            result = original(weights, *args, **kwargs)
            if result is not None:
                self.reported = True
                self.names.update(n.replace(".base_layer.", ".") for n in result)
            return result

        # An instance attribute shadows the class method only for this block.
        self.model.load_weights = load_weights
        return self

    def __exit__(self, *exc) -> bool:
        self.model.__dict__.pop("load_weights", None)
        return False
