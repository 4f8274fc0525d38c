"""MoE router safety: no router logits or aux loss in RL by default; the opt-in trains the router only in
training forwards, by exactly router_aux_loss_coef * aux_loss."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.models.moe_router import configure_moe_router, router_configs
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5


def _moe(**kw):
    model = build_tiny_qwen3_5(kind="moe", with_tokenizer=False, output_router_logits=True,
                               router_aux_loss_coef=0.5, **kw)
    return model


def _ids():
    return torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(0))


def test_off_by_default_even_when_the_checkpoint_turns_it_on():
    model = _moe()
    assert model.config.output_router_logits
    assert configure_moe_router(model, OmegaConf.create({}), "actor") is False
    model.train()
    out = model(input_ids=_ids())
    assert out.aux_loss is None and out.router_logits is None  # nothing materialised


def test_dense_models_are_untouched():
    dense = build_tiny_qwen3_5(kind="dense", with_tokenizer=False)
    assert router_configs(dense.config) == []
    assert configure_moe_router(dense, OmegaConf.create({"enable_router_aux_loss": True}), "actor") is False


def test_opt_in_adds_coef_times_aux_loss_gradient_in_training_forwards_only():
    torch.manual_seed(0)
    model = _moe()
    reference = _moe()
    reference.load_state_dict(model.state_dict())
    assert configure_moe_router(model, OmegaConf.create({"enable_router_aux_loss": True}), "actor") is True
    assert configure_moe_router(reference, OmegaConf.create({}), "actor") is False
    ids = _ids()

    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).router_logits is None  # rollout / log-prob passes: no router logits

    model.train()
    reference.train()
    out = model(input_ids=ids)
    assert out.aux_loss is not None
    out.logits.float().logsumexp(-1).mean().backward()
    ref_out = reference(input_ids=ids, output_router_logits=True)
    (ref_out.logits.float().logsumexp(-1).mean() + 0.5 * ref_out.aux_loss).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    router = [n for n, p in model.named_parameters() if "gate" in n and p.grad is not None]
    assert router, "the router must receive gradient"


def test_reference_and_critic_never_train_the_router():
    model = _moe()
    assert configure_moe_router(model, OmegaConf.create({"enable_router_aux_loss": True}), "ref") is False
    assert model.config.output_router_logits is False


def test_critic_key_is_refused():
    from verl.trainer.config import ConfigValidationError, validate_config
    from verl.trainer.config.checks import compose_config

    cfg = compose_config("ppo_trainer", ["critic.model.enable_router_aux_loss=true"], validate=False)
    with pytest.raises(ConfigValidationError, match="critic.model.enable_router_aux_loss"):
        validate_config(cfg)
