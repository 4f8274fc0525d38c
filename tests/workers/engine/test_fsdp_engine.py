"""The FSDP engine on one gloo rank (CPU): forward against HF, micro-batch invariance, offload round trip,
per-tensor parameters, checkpoints, and the registry alias."""

import logging

import pytest
import torch
from omegaconf import open_dict

from tests.engine_utils import arr_config, make_engine, ragged_batch, sgd
from verl.protocol import DataProto


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("engine_dense")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)




def hf_next_token_log_probs(model_dir, batch):
    """Per sequence, unpadded, through the stock HF model: log p(token t+1 | <= t) placed at position t."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i in range(len(out)):
            real = batch["attention_mask"][i].nonzero().squeeze(-1)
            ids = batch["input_ids"][i, real][None]
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1]
            out[i, real[:-1]] = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("rmpad", [True, False])
def test_forward_equals_hf_per_sequence_log_probs(gloo, model_dir, rmpad):
    cfg = arr_config(model_dir, [f"actor_rollout_ref.model.use_remove_padding={rmpad}"])
    engine = make_engine(cfg.ref, cfg.model, role="ref")
    assert engine.use_remove_padding == rmpad
    batch = ragged_batch()
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "micro_batch_size": 4})
    out = engine.infer_batch(data, outputs=("log_probs", "entropy"))
    assert out["log_probs"].shape == batch["input_ids"].shape and out["entropy"].shape == batch["input_ids"].shape
    want = hf_next_token_log_probs(model_dir, batch)
    # positions whose next token is real (the data contract: position t scores token t + 1)
    scored = batch["attention_mask"].bool() & torch.roll(batch["attention_mask"], -1, -1).bool()
    scored[:, -1] = False
    torch.testing.assert_close(out["log_probs"][scored], want[scored], atol=2e-5, rtol=1e-4)


def _train_delta(model_dir, meta, n_steps=1):
    cfg = arr_config(model_dir)
    engine = make_engine(sgd(cfg.actor, lr=1.0), cfg.model, role="actor")
    from verl.workers.actor.ppo_actor import PolicyLoss

    with open_dict(cfg.actor):
        cfg.actor.entropy_coeff = 0.01
    loss_fn = PolicyLoss(cfg.actor)
    before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    data = DataProto.from_dict(tensors=ragged_batch(n=8), meta_info={"temperature": 0.8, **meta})
    metrics = engine.train_batch(data, loss_fn, outputs=("log_probs", "entropy"))
    after = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    return metrics, {k: before[k] - after[k] for k in before}


def test_train_batch_does_not_depend_on_the_micro_batch_split(gloo, model_dir):
    m_one, d_one = _train_delta(model_dir, {"micro_batch_size": 8})
    m_split, d_split = _train_delta(model_dir, {"micro_batch_size": 3})
    m_dyn, d_dyn = _train_delta(model_dir, {"use_dynamic_bsz": True, "max_token_len": 20})
    assert any(v.abs().max() > 0 for v in d_one.values())
    for m in (m_split, m_dyn):
        assert m["actor/pg_loss"] == pytest.approx(m_one["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert m["actor/entropy"] == pytest.approx(m_one["actor/entropy"], rel=1e-4)
        assert m["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)
    for k in d_one:
        torch.testing.assert_close(d_split[k], d_one[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(d_dyn[k], d_one[k], rtol=1e-4, atol=1e-6)


def test_non_finite_grad_skips_the_step(gloo, model_dir):
    cfg = arr_config(model_dir)
    engine = make_engine(sgd(cfg.actor), cfg.model, role="actor")
    before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    data = DataProto.from_dict(tensors=ragged_batch(), meta_info={"temperature": 1.0, "micro_batch_size": 6})

    def nan_loss(outputs, mb):
        return outputs["log_probs"].sum() * float("nan"), {}

    metrics = engine.train_batch(data, nan_loss)
    assert metrics["grad_norm"] != metrics["grad_norm"]  # NaN reported
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v.full_tensor(), before[k]), k


def test_offload_round_trip_keeps_weights_and_optimizer_state(gloo, model_dir):
    cfg = arr_config(model_dir)
    engine = make_engine(cfg.actor, cfg.model, role="actor")  # AdamW: has moment tensors
    from verl.workers.actor.ppo_actor import PolicyLoss

    data = DataProto.from_dict(tensors=ragged_batch(), meta_info={"temperature": 1.0, "micro_batch_size": 6})
    engine.train_batch(data, PolicyLoss(cfg.actor))
    params = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    states = {id(p): {k: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for k, t in s.items()}
              for p, s in engine.optimizer.state.items()}
    assert states
    engine.to("cpu")
    for s in engine.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    engine.to("device")
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v.full_tensor(), params[k]), k
    for p, s in engine.optimizer.state.items():
        for k, t in s.items():
            assert torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, states[id(p)][k])
    engine.train_batch(data, PolicyLoss(cfg.actor))  # still trains after the round trip


def test_per_tensor_params_cover_the_model(gloo, model_dir):
    from transformers import AutoModelForCausalLM

    cfg = arr_config(model_dir)
    engine = make_engine(cfg.ref, cfg.model, role="ref")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    got = dict(engine.get_per_tensor_param(bucket_megabytes=0.01))
    if hf_tied := getattr(engine.module.config, "tie_word_embeddings", False):
        hf.pop("lm_head.weight", None)
        got.pop("lm_head.weight", None)
    assert set(got) == set(hf), (hf_tied, set(got) ^ set(hf))
    for k, v in hf.items():
        torch.testing.assert_close(got[k], v, msg=k)
    weights, kwargs = engine.get_rollout_weights()
    assert kwargs == {} and len(list(weights)) == len(got)


def test_checkpoint_round_trip_restores_weights_optimizer_and_lr(gloo, model_dir, tmp_path):
    from verl.workers.actor.ppo_actor import PolicyLoss

    cfg = arr_config(model_dir)
    with open_dict(cfg.actor):
        cfg.actor.optim.lr_warmup_steps = 3
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    data = DataProto.from_dict(tensors=ragged_batch(), meta_info={"temperature": 1.0, "micro_batch_size": 6})
    engine.train_batch(data, PolicyLoss(cfg.actor))
    lr_used = engine.lr_scheduler_step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    assert (tmp_path / "ckpt" / "model_world_size_1_rank_0.pt").exists()
    assert (tmp_path / "ckpt" / "optim_world_size_1_rank_0.pt").exists()
    assert (tmp_path / "ckpt" / "huggingface" / "config.json").exists()
    saved = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    fresh = make_engine(cfg.actor, cfg.model, role="actor")
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(v.full_tensor(), saved[k]), k
    assert fresh.lr_scheduler.get_last_lr() == engine.lr_scheduler.get_last_lr() != [lr_used]
    m1 = engine.train_batch(data, PolicyLoss(cfg.actor))
    m2 = fresh.train_batch(data, PolicyLoss(cfg.actor))
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-6)
    with pytest.raises(RuntimeError, match="no trainable state"):
        make_engine(cfg.ref, cfg.model, role="ref").save_checkpoint(str(tmp_path / "ref"))


def test_registry_alias_resolves_and_warns_once(caplog):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import FSDPEngine, engine as engine_mod

    assert EngineRegistry.get_or_raise("fsdp") is FSDPEngine
    assert EngineRegistry.get_or_raise("fsdp2") is FSDPEngine
    engine_mod._alias_warned = False
    with caplog.at_level(logging.WARNING, logger=engine_mod.__name__):
        FSDPEngine({}, {}, strategy="fsdp")
        FSDPEngine({}, {}, strategy="fsdp")
        FSDPEngine({}, {}, strategy="fsdp2")
    warnings = [r for r in caplog.records if "FSDP2" in r.getMessage()]
    assert len(warnings) == 1 and "strategy=fsdp" in warnings[0].getMessage()
    with pytest.raises(ValueError, match="did you mean"):
        EngineRegistry.get_or_raise("fsdp3")
