"""The top-level forward of a patched Qwen3.5 causal LM: which backend apply_monkey_patch installs, what the normal
(logits) backend returns, the MoE router aux loss through it, and HF generate through every backend."""

import pytest
import torch
from omegaconf import OmegaConf

from qwen35_test_utils import make_image_sample, patched_copy, random_ids
from verl.models.moe_router import configure_moe_router
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.models.transformers.fused_forward import CausalLMOutputForPPO


def _top_level_name(model):
    forward = model.__dict__.get("forward")
    return None if forward is None else forward.__func__.__name__


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_backend_installed_per_setting(tiny_models, kind):
    # Without fused kernels the seed's normal backend is the model's forward; with them, the fused one.
    assert _top_level_name(patched_copy(tiny_models(kind))) == "forward_with_normal_backend"
    fused = patched_copy(tiny_models(kind), use_fused_kernels=True, fused_kernels_backend="torch")
    assert _top_level_name(fused) == "forward_with_torch_backend"


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_normal_backend_logits_match_stock_on_padded_rows(tiny_models, kind):
    model = tiny_models(kind)
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([random_ids(9, gen), random_ids(9, gen)], 0)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    out = patched_copy(model)(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, temperature=0.5)
    assert isinstance(out, CausalLMOutputForPPO) and out.aux_loss is None
    # Real tokens only (stock pads attend to nothing useful); the temperature is not applied by the model.
    torch.testing.assert_close(out.logits[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=0)
    kept = patched_copy(model)(input_ids=ids[1:], use_cache=False, logits_to_keep=1).logits
    assert kept.shape == (1, 1, ref.shape[-1])
    torch.testing.assert_close(kept[0, 0], model(input_ids=ids[1:]).logits[0, -1], atol=2e-5, rtol=0)


def test_labels_give_the_stock_loss(tiny_models):
    model = tiny_models("dense")
    ids = random_ids(10, torch.Generator().manual_seed(6))
    ref = model(input_ids=ids, labels=ids).loss
    got = patched_copy(model)(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_through_every_backend(tiny_models, kind, fused):
    """The hf rollout generates with the actor's (patched) module: cached decoding must reach the stock forward,
    fused kernels included (they produce no logits to sample from)."""
    model = tiny_models(kind)
    ids = random_ids(6, torch.Generator().manual_seed(7))
    ref = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    patched = patched_copy(model, use_fused_kernels=fused, fused_kernels_backend="torch" if fused else None)
    assert torch.equal(patched.generate(input_ids=ids, max_new_tokens=5, do_sample=False), ref)


@pytest.mark.parametrize("fused", [False, True])
def test_generate_with_an_image(tiny_models, fused):
    # generate() checks the forward's signature for pixel inputs, position_ids and logits_to_keep.
    model = tiny_models("vl")
    sample = make_image_sample(3, (1, 4, 4), 2, torch.Generator().manual_seed(8))
    ref = model.generate(**sample, max_new_tokens=4, do_sample=False)
    patched = patched_copy(model, use_fused_kernels=fused, fused_kernels_backend="torch" if fused else None)
    assert torch.equal(patched.generate(**sample, max_new_tokens=4, do_sample=False), ref)


def _moe_with_router_loss():
    return build_tiny_qwen3_5(kind="moe", with_tokenizer=False, output_router_logits=True, router_aux_loss_coef=0.5)


def test_router_aux_loss_matches_stock_on_packed_and_padded_rows():
    model = _moe_with_router_loss().train()
    gen = torch.Generator().manual_seed(9)
    a, b = random_ids(7, gen), random_ids(5, gen)
    stock_a = model(input_ids=a).aux_loss
    patched = patched_copy(model)
    out = patched(input_ids=a, position_ids=torch.arange(7)[None], use_cache=False)
    torch.testing.assert_close(out.aux_loss, stock_a, atol=1e-6, rtol=0)
    n_layers, n_experts = model.config.num_hidden_layers, model.config.num_experts
    assert len(out.router_logits) == n_layers and out.router_logits[0].shape == (7, n_experts)  # every layer MoE
    # Pads never reach the routers: a left-padded row gives the unpadded row's loss.
    padded = torch.cat([torch.zeros(1, 2, dtype=a.dtype), b], 1)
    mask = torch.cat([torch.zeros(1, 2), torch.ones(1, 5)], 1).long()
    got = patched(input_ids=padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  use_cache=False).aux_loss
    torch.testing.assert_close(got, model(input_ids=b).aux_loss, atol=1e-6, rtol=0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_router_aux_loss_trains_the_router_through_the_patched_forward(checkpointing):
    """enable_router_aux_loss on the actor: the hook in verl.models.moe_router adds coef * aux_loss through the
    logits of the patched forward, as it does for the stock one; also under the engine's (non-reentrant)
    activation checkpointing, whose recompute must not record the routers twice."""
    torch.manual_seed(0)
    patched, reference = _moe_with_router_loss(), _moe_with_router_loss()
    reference.load_state_dict(patched.state_dict())
    assert configure_moe_router(patched, OmegaConf.create({"enable_router_aux_loss": True}), "actor")
    if checkpointing:
        patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patched = patched_copy(patched)
    patched.train()
    reference.train()
    ids = random_ids(8, torch.Generator().manual_seed(10))
    out = patched(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False)
    out.logits.float().logsumexp(-1).mean().backward()
    ref = reference(input_ids=ids, output_router_logits=True)
    (ref.logits.float().logsumexp(-1).mean() + 0.5 * ref.aux_loss).backward()
    grads = dict(reference.named_parameters())
    routed = 0
    for name, p in patched.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        routed += name.endswith("mlp.gate.weight")
    assert routed == patched.config.num_hidden_layers  # every layer's router got the aux-loss gradient


def test_fused_kernels_refuse_router_aux_loss():
    patched = patched_copy(_moe_with_router_loss(), use_fused_kernels=True, fused_kernels_backend="torch")
    with pytest.raises(ValueError, match="use_fused_kernels=false"):
        patched(input_ids=random_ids(5, torch.Generator().manual_seed(11)), use_cache=False)
