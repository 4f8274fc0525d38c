"""Reload names for an engine whose layers vLLM wrapped for LoRA (pure torch stand-ins of vLLM's wrappers)."""

from torch import nn

from verl.utils.vllm.reload import lora_base_layer_renamer


class _Wrapped(nn.Module):
    """STAND-IN for vLLM's LoRA wrapper: the original layer lives on as ``base_layer``."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base


class _Model(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, wrap: bool):
        super().__init__()
        layer = nn.Module()
        layer.qkv_proj = nn.Linear(4, 12)
        layer.conv1d = nn.Linear(4, 4)
        layer.norm = nn.LayerNorm(4)
        if wrap:
            layer.qkv_proj, layer.conv1d = _Wrapped(layer.qkv_proj), _Wrapped(layer.conv1d)
        self.layers = nn.ModuleList([layer])


def test_wrapped_layers_and_the_leaves_packed_into_them_get_base_layer():
    rename = lora_base_layer_renamer(_Model(wrap=True))
    assert rename("layers.0.conv1d.weight") == "layers.0.conv1d.base_layer.weight"
    assert rename("layers.0.q_proj.weight") == "layers.0.q_proj.base_layer.weight"  # the loader maps q -> qkv
    assert rename("layers.0.norm.weight") == "layers.0.norm.weight"  # not an adaptable layer


def test_an_engine_without_lora_keeps_checkpoint_names():
    assert lora_base_layer_renamer(_Model(wrap=False)) is None


def test_names_a_module_reported_relative_to_itself_resolve_to_its_delegates_parameters():
    from verl.utils.vllm.reload import resolve_delegated_names

    params = {"m.layers.0.mlp.experts.routed_experts.w13_weight", "m.layers.0.mlp.experts.routed_experts.w2_weight",
              "m.layers.0.mlp.gate.weight", "m.e.a.w", "m.e.b.w"}
    reported = {"m.layers.0.mlp.experts.w13_weight", "m.layers.0.mlp.gate.weight", "m.e.w", "m.nothing.w"}
    resolved = resolve_delegated_names(reported, params)
    assert "m.layers.0.mlp.experts.routed_experts.w13_weight" in resolved and "m.layers.0.mlp.gate.weight" in resolved
    # ambiguous (two candidates) or unknown names stay as reported: the coverage check still sees what is missing
    assert {"m.e.w", "m.nothing.w"} <= resolved and not {"m.e.a.w", "m.e.b.w"} & resolved
    assert "m.layers.0.mlp.experts.routed_experts.w2_weight" not in resolved  # never reported: still missing


class _RoutedExperts(nn.Module):
    """STAND-IN for vLLM 0.26's routed experts: the name mapping a reload builds carries ``lora_base_layer_prefix``
    (``"base_layer."`` once LoRA wrapped the MoE layer), and the mapped name is looked up on the module itself."""

    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(nn.init.zeros_(nn.Linear(2, 2).weight))
        self.lora_base_layer_prefix = "base_layer."

    def load_weights(self):
        return getattr(self, f"{self.lora_base_layer_prefix}w13_weight")


def test_routed_experts_load_without_the_lora_prefix_and_get_it_back():
    from verl.utils.vllm.reload import routed_experts_without_lora_prefix

    model = nn.Module()
    model.experts = _Wrapped(nn.Module())
    model.experts.base_layer.routed_experts = _RoutedExperts()
    experts = model.experts.base_layer.routed_experts
    try:
        experts.load_weights()
    except AttributeError:
        pass  # what the reload met on the GPU
    else:
        raise AssertionError("the stand-in must fail like vLLM 0.26 does with the prefix set")
    with routed_experts_without_lora_prefix(model) as n:
        assert n == 1
        assert experts.load_weights() is experts.w13_weight
    assert experts.lora_base_layer_prefix == "base_layer."
