"""iter_hf_weights on a real FSDP2 (DTensor) model, with wrappers and PEFT LoRA (gloo, world size 1)."""

import pytest
import torch
from _ws_helpers import tiny
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from verl.workers.weight_sync import iter_hf_weight_buckets, iter_hf_weights
from verl.workers.weight_sync.gather import full_tensor


def _fsdp2(model):
    mesh = init_device_mesh("cpu", (1,))
    layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fsdp2_yields_full_hf_tensors(gloo_group, kind):
    ref = {n: p.detach().clone() for n, p in tiny(kind, fresh=True).named_parameters()}
    model = _fsdp2(tiny(kind, fresh=True))
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())  # really sharded params
    got = dict(iter_hf_weights(model, bucket_megabytes=0.25))
    assert list(got) == list(ref)
    for n, t in got.items():
        assert type(t) is torch.Tensor, n
        torch.testing.assert_close(t, ref[n], rtol=0, atol=0)


def test_bucket_bound_and_layered(gloo_group):
    model = _fsdp2(tiny("moe", fresh=True))
    limit = 0.25
    buckets = list(iter_hf_weight_buckets(model, bucket_megabytes=limit))
    assert len(buckets) > 2
    for b in buckets:
        nbytes = sum(t.numel() * t.element_size() for _, t in b)
        assert len(b) == 1 or nbytes <= limit * (1 << 20)  # an oversized tensor travels alone
    layered = list(iter_hf_weight_buckets(model, layered=True, dtype=torch.bfloat16))
    layer_buckets = [b for b in layered if b[0][0].startswith("model.layers.")]
    assert len(layer_buckets) == 4  # one bucket per decoder layer
    for i, b in enumerate(layer_buckets):
        assert all(n.startswith(f"model.layers.{i}.") for n, _ in b)
    assert all(t.dtype == torch.bfloat16 for b in layered for _, t in b)
    flat = [n for b in layered for n, _ in b]
    assert flat == [n for b in buckets for n, _ in b]  # same tensors, same order


def test_checkpoint_wrapper_names_are_stripped(gloo_group):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny("dense", fresh=True)
    want = [n for n, _ in model.named_parameters()]
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert [n for n, _ in iter_hf_weights(_fsdp2(model))] == want


def _peft(model, **kw):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv", "down_proj"], **kw)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # PEFT initialises B to zero; make the adapter non-trivial
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return peft_model, cfg


def test_peft_merged_base_and_adapter_modes(gloo_group, tmp_path):
    peft_model, _ = _peft(tiny("dense", fresh=True))
    # Reference values from PEFT itself, computed before FSDP2 touches the model.
    peft_model.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    base = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    import copy

    merged_ref = {n: p.detach() for n, p in copy.deepcopy(peft_model).merge_and_unload().named_parameters()}
    _fsdp2(peft_model.base_model.model)

    merged = dict(iter_hf_weights(peft_model, lora_mode="merged"))
    assert list(merged) == list(merged_ref)
    for n, t in merged.items():
        torch.testing.assert_close(t, merged_ref[n], rtol=1e-5, atol=1e-6)
    q = "model.layers.3.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base["base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight"])

    unmerged = dict(iter_hf_weights(peft_model, lora_mode="base"))
    assert list(unmerged) == list(merged_ref)
    torch.testing.assert_close(unmerged[q], base["base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight"])

    adapter = dict(iter_hf_weights(peft_model, lora_mode="adapter"))
    assert sorted(adapter) == sorted(saved)  # exactly PEFT's saved names
    for n, t in adapter.items():
        torch.testing.assert_close(t, saved[n])


def test_adapter_mode_without_lora_fails():
    with pytest.raises(ValueError, match="no PEFT LoRA"):
        list(iter_hf_weights(tiny("dense"), lora_mode="adapter"))
    with pytest.raises(ValueError, match="lora_mode"):
        list(iter_hf_weights(tiny("dense"), lora_mode="fused"))


def test_full_tensor_passthrough():
    t = torch.ones(3)
    assert full_tensor(t) is t
