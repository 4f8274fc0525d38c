"""npu_vllm_patch: supported-version window and the FusedMoE loader wrapper (fake modules, no NPU)."""

import sys
import types

import pytest
import torch

import verl.models  # noqa: F401  (registers the model specs the version floor is read from)
from verl.utils.vllm import npu_vllm_patch as npp


@pytest.mark.parametrize("version", ["0.13.0", "0.18.0", "0.18.0rc1", "0.18.1+ascend"])
def test_supported_versions_pass(version):
    npp.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.12.9", "0.19.0", "0.33.0"])
def test_outside_window_names_versions(version):
    with pytest.raises(npp.UnsupportedVllmVersion, match=rf"vllm>=0\.13\.0,<0\.19\.0; found vllm {version}"):
        npp.check_vllm_version(version)


def _config(model_type, architecture):
    return types.SimpleNamespace(model_type=model_type, architectures=[architecture])


def test_qwen3_5_needs_its_model_specs_floor():
    """The floor comes from the model spec (ModelSpec.min_vllm_ascend), found by the checkpoint's architecture."""
    from verl.models.registry import get_model_spec

    moe = _config("qwen3_5_moe", "Qwen3_5MoeForCausalLM")
    assert get_model_spec(moe).min_vllm_ascend == "0.18.0"
    with pytest.raises(npp.UnsupportedVllmVersion, match=r"Qwen3_5MoeForCausalLM on Ascend needs vllm>=0\.18\.0"):
        npp.check_vllm_version("0.14.0", moe)
    npp.check_vllm_version("0.14.0", _config("qwen3_moe", "Qwen3MoeForCausalLM"))  # generic spec: no floor
    npp.check_vllm_version("0.18.0", _config("qwen3_5", "Qwen3_5ForConditionalGeneration"))


class _FakeFusedMoE:
    hidden_size = 8

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        # Checkpoint-layout loader: w1/w3 rows go into dim 1 of [E, 2I, H].
        self.seen = tuple(param.shape)
        return True


def test_loader_wrapper_restores_checkpoint_layout():
    cls = type("FusedMoE", (_FakeFusedMoE,), {})
    assert npp.patch_fused_moe_class(cls)
    first = cls.weight_loader
    assert npp.patch_fused_moe_class(cls) and cls.weight_loader is first  # idempotent
    layer = cls()
    runtime = torch.nn.Parameter(torch.zeros(2, 8, 6))  # [E, H, 2I]: post-processed
    layer.weight_loader(runtime, torch.zeros(3, 8), "w", "w1", 0)
    assert layer.seen == (2, 6, 8) and layer._verl_skip_post_process is False
    ckpt = torch.nn.Parameter(torch.zeros(2, 6, 8))
    layer.weight_loader(ckpt, torch.zeros(3, 8), "w", "w3", 1)
    assert layer.seen == (2, 6, 8)  # untouched
    assert not npp.patch_fused_moe_class(lambda: None)  # modular vLLM: factory, not a class


def test_apply_is_noop_off_npu():
    assert npp.apply_npu_vllm_patches(_config("qwen3_5", "Qwen3_5ForCausalLM")) is False


def test_apply_with_fake_vllm(monkeypatch):
    fused_moe = types.ModuleType("vllm.model_executor.layers.fused_moe")
    fused_moe.FusedMoE = type("FusedMoE", (_FakeFusedMoE,), {})
    fake = {
        "vllm": types.SimpleNamespace(__version__="0.18.0"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.layers": types.ModuleType("vllm.model_executor.layers"),
        "vllm.model_executor.layers.fused_moe": fused_moe,
    }
    fake["vllm.model_executor.layers"].fused_moe = fused_moe
    for k, v in fake.items():
        monkeypatch.setitem(sys.modules, k, v)
    moe = _config("qwen3_5_moe", "Qwen3_5MoeForCausalLM")
    assert npp.apply_npu_vllm_patches(moe, force=True)
    fake["vllm"].__version__ = "0.20.0"
    with pytest.raises(npp.UnsupportedVllmVersion):
        npp.apply_npu_vllm_patches(moe, force=True)
