"""apply_monkey_patch: dispatch, idempotence, other models untouched, fused log-prob backends."""

import copy

import pytest
import torch
import transformers as tf

from qwen35_test_utils import packed_positions, patched_copy, random_ids
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.models.transformers.fused_forward import CausalLMOutputForPPO


def _instance_forwards(model):
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


def _tiny_llama():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    return tf.LlamaForCausalLM(cfg).eval()


def _tiny_qwen2():
    # Qwen2 has no package of its own (Qwen3 does, since it became the second registered architecture).
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    return tf.Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_patches_expected_modules(tiny_models, kind):
    model = patched_copy(tiny_models(kind))
    patched = _instance_forwards(model)
    names = set(patched)
    n_layers = model.config.get_text_config().num_hidden_layers
    assert sum(".linear_attn" in n for n in names) == 3
    assert sum(n.endswith("self_attn") for n in names) == 1
    assert sum(n.endswith(tuple(f"layers.{i}" for i in range(n_layers))) for n in names) == n_layers
    if kind == "vl":
        assert "model" in names and "model.visual" in names and "model.language_model" in names
    else:
        assert "model" in names
    # The source model (same classes) is untouched: the patch lives on instances only.
    assert _instance_forwards(tiny_models(kind)) == {}


def test_idempotent(tiny_models):
    model = patched_copy(tiny_models("dense"))
    first = _instance_forwards(model)
    apply_monkey_patch(model)
    assert _instance_forwards(model) == first
    gen = torch.Generator().manual_seed(0)
    ids = random_ids(10, gen)
    once = model(input_ids=ids, position_ids=torch.arange(10)[None]).logits
    apply_monkey_patch(model)
    twice = model(input_ids=ids, position_ids=torch.arange(10)[None]).logits
    torch.testing.assert_close(once, twice, atol=0, rtol=0)


def test_repatch_with_other_settings_switches_backend(tiny_models):
    model = patched_copy(tiny_models("dense"))
    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="torch")
    ids = random_ids(6, torch.Generator().manual_seed(0))
    assert model(input_ids=ids, use_cache=False).log_probs is not None
    apply_monkey_patch(model)  # back to plain logits
    assert model(input_ids=ids, use_cache=False).logits.shape == (1, 6, model.config.vocab_size)


@pytest.mark.parametrize("factory", [_tiny_llama, _tiny_qwen2])
def test_other_models_untouched(factory):
    model = factory()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    before = model(input_ids=ids, attention_mask=mask).logits
    apply_monkey_patch(model, use_remove_padding=True)
    assert _instance_forwards(model) == {}
    after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    with pytest.raises(NotImplementedError):
        apply_monkey_patch(copy.deepcopy(model), ulysses_sp_size=2)


def _fused_vs_normal(model, temperature, **inputs):
    ids = inputs["input_ids"]
    normal = patched_copy(model)
    fused = patched_copy(model, use_fused_kernels=True, fused_kernels_backend="torch")
    logits = normal(**inputs, use_cache=False).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)
    ref_lp = logp.gather(-1, torch.roll(ids, -1, dims=-1)[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    out = fused(**inputs, use_cache=False, temperature=temperature)
    assert isinstance(out, CausalLMOutputForPPO)
    assert out.log_probs.shape == ids.shape and out.entropy.shape == ids.shape
    torch.testing.assert_close(out.log_probs, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=0)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    (ref_lp * w + ref_ent).sum().backward()
    (out.log_probs * w + out.entropy).sum().backward()
    for (name, p_ref), (_, p_got) in zip(normal.named_parameters(), fused.named_parameters()):
        if p_ref.grad is not None:
            torch.testing.assert_close(p_got.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_torch_backend_matches_normal_backend_packed(tiny_models, kind):
    gen = torch.Generator().manual_seed(2)
    lengths = [6, 9]
    ids = torch.cat([random_ids(n, gen) for n in lengths], 1)
    pos = packed_positions(lengths)
    if kind == "vl":
        pos = pos[None].expand(3, -1, -1)
    _fused_vs_normal(tiny_models(kind), 0.7, input_ids=ids, position_ids=pos, attention_mask=None)


def test_torch_backend_matches_normal_backend_padded(tiny_models):
    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([random_ids(8, gen), random_ids(8, gen)], 0)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    _fused_vs_normal(tiny_models("dense"), 1.0, input_ids=ids, attention_mask=mask, position_ids=pos)


def test_fused_on_generic_model_matches_logits():
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    _fused_vs_normal(_tiny_llama(), 0.5, input_ids=ids)


def test_bad_backend_rejected(tiny_models):
    with pytest.raises(ValueError):
        patched_copy(tiny_models("dense"), use_fused_kernels=True, fused_kernels_backend="liger")
