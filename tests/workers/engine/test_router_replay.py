"""MoE router replay in the FSDP engine (actor_rollout_ref.actor.fsdp_config.router_replay.mode), on one gloo
rank with the tiny fp32 Qwen3.5 MoE: the replay function on a stand-in router, recording in the engine's
forward, replaying its own routes (identical log-probs) and other routes (different log-probs), routes following
the tokens through packing and micro-batching, and replay surviving activation checkpointing's recompute."""

import pytest
import torch
from omegaconf import open_dict

from tests.engine_utils import arr_config, make_engine, ragged_batch, sgd
from verl.models.transformers.router_replay import RouterTape, replay_topk
from verl.protocol import DataProto


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def stand_in_router(seed=0, experts=6, k=2, hidden=8):
    """transformers' own Qwen3.5 MoE router with random weights (the class the replay hooks target)."""
    import transformers as tf
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    cfg = tf.Qwen3_5MoeTextConfig(num_experts=experts, num_experts_per_tok=k, hidden_size=hidden)
    router = Qwen3_5MoeTopKRouter(cfg)
    torch.manual_seed(seed)
    torch.nn.init.normal_(router.weight, std=1.0)
    return router


def test_replay_topk_on_a_stand_in_router():
    router = stand_in_router()
    x = torch.randn(7, 8)
    logits, weights, idx = router(x)
    # its own routes: exactly the router's weights and indices
    w2, i2 = replay_topk(logits, idx, idx)
    assert torch.equal(i2, idx) and torch.equal(w2, weights)
    # other routes: the softmax over all experts at those experts, renormalised; -1 rows keep their own
    other = (idx + 1) % 6
    other[3] = -1
    w3, i3 = replay_topk(logits, idx, other)
    probs = torch.softmax(logits, -1)
    want = probs.gather(-1, other.clamp(min=0))
    want = want / want.sum(-1, keepdim=True)
    keep = torch.arange(7) != 3
    torch.testing.assert_close(w3[keep], want[keep])
    assert torch.equal(i3[keep], other[keep]) and torch.equal(i3[3], idx[3]) and torch.equal(w3[3], weights[3])
    # the weights carry gradients to the router through the softmax
    assert w3.requires_grad


def test_tape_records_and_replays_through_a_hook():
    router = stand_in_router(seed=1)
    holder = torch.nn.Sequential(router)
    tape = RouterTape(holder)
    x = torch.randn(5, 8)
    with tape.recording():
        _, _, idx = holder(x)
    assert torch.equal(tape.stacked()[:, 0], idx)
    forced = torch.tensor([[0, 1]] * 5)
    with tape.replaying(forced[:, None]):
        _, w, i = holder(x)
    assert torch.equal(i, forced)
    with pytest.raises(ValueError, match="routes for"):
        with tape.replaying(forced[:3, None]):
            holder(x)
    tape.remove()
    assert torch.equal(holder(x)[2], idx)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("engine_moe")
    build_tiny_qwen3_5(str(path), kind="moe", seed=0, initializer_range=0.3)
    return str(path)




def _engine(moe_dir, mode="R2", rmpad=True, role="actor", gc=False, lr=None):
    cfg = arr_config(moe_dir, [f"actor_rollout_ref.model.use_remove_padding={rmpad}",
                               f"actor_rollout_ref.actor.fsdp_config.router_replay.mode={mode}"])
    if gc:
        with open_dict(cfg):
            cfg.model.enable_gradient_checkpointing = True
    actor = sgd(cfg.actor, lr) if lr is not None else cfg.actor
    return make_engine(actor, cfg.model, role=role), cfg


def _infer(engine, batch, outputs=("log_probs",), **meta):
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "micro_batch_size": 4, **meta})
    return engine.infer_batch(data, outputs=outputs)


def hf_topk(model_dir, batch):
    """(B, L, layers, k) the stock HF model's routers pick per unpadded sequence (this test's own hooks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    out = torch.full((*batch["input_ids"].shape, len(gates), 2), -1, dtype=torch.long)
    with torch.no_grad():
        for i in range(len(out)):
            real = batch["attention_mask"][i].nonzero().squeeze(-1)
            picked = []
            hooks = [g.register_forward_hook(lambda m, a, o: picked.append(o[2])) for g in gates]
            model(input_ids=batch["input_ids"][i, real][None])
            for h in hooks:
                h.remove()
            out[i, real] = torch.stack(picked, 1)
    return out


def scored(batch):
    """Positions whose next token is real (position t scores token t + 1)."""
    real = batch["attention_mask"].bool()
    s = real & torch.roll(real, -1, -1)
    s[:, -1] = False
    return s


def shifted(routes, experts=4):
    """Other routes for the real tokens: every expert id moved by one."""
    return torch.where(routes >= 0, (routes + 1) % experts, routes)


@pytest.mark.parametrize("rmpad", [True, False])
def test_record_then_replay(gloo, moe_dir, rmpad):
    engine, _ = _engine(moe_dir, rmpad=rmpad)
    batch = ragged_batch()
    normal = _infer(engine, batch)["log_probs"]
    rec = _infer(engine, batch, outputs=("log_probs", "routed_experts"))
    routes = rec["routed_experts"]
    assert routes.shape[:2] == batch["input_ids"].shape
    assert torch.equal(rec["log_probs"], normal)
    real = batch["attention_mask"].bool()
    assert (routes[~real] == -1).all()
    assert torch.equal(routes[real].long().sort(-1).values, hf_topk(moe_dir, batch)[real].sort(-1).values)

    same = _infer(engine, {**batch, "routed_experts": routes})["log_probs"]
    assert torch.equal(same, normal)  # replaying its own routes changes nothing, bit for bit

    other = _infer(engine, {**batch, "routed_experts": shifted(routes)})["log_probs"]
    assert (other - normal)[scored(batch)].abs().max() > 1e-3


def test_routes_follow_tokens_through_micro_batches(gloo, moe_dir):
    """Replayed (shifted) routes give the same log-probs however the rows are packed and split: a route
    landing on the wrong token would change them."""
    engine, _ = _engine(moe_dir)
    batch = ragged_batch(n=8, seed=1)
    routes = _infer(engine, batch, outputs=("log_probs", "routed_experts"))["routed_experts"]
    forced = {**batch, "routed_experts": shifted(routes)}
    one = _infer(engine, forced, micro_batch_size=8)["log_probs"]
    split = _infer(engine, forced, micro_batch_size=3)["log_probs"]
    dyn = _infer(engine, forced, use_dynamic_bsz=True, max_token_len=20)["log_probs"]
    s = scored(batch)  # a sequence's last position scores whatever follows it in the packed row
    torch.testing.assert_close(split[s], one[s], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dyn[s], one[s], atol=1e-6, rtol=1e-5)
    normal = _infer(engine, batch, micro_batch_size=8)["log_probs"]
    assert (one - normal)[s].abs().max() > 1e-3


def test_disabled_engine_ignores_routes_and_refuses_recording(gloo, moe_dir):
    engine, _ = _engine(moe_dir, mode="disabled")
    batch = ragged_batch()
    normal = _infer(engine, batch)["log_probs"]
    fake = torch.zeros(*batch["input_ids"].shape, 2, 2, dtype=torch.int16)
    assert torch.equal(_infer(engine, {**batch, "routed_experts": fake})["log_probs"], normal)
    with pytest.raises(ValueError, match="router_replay"):
        _infer(engine, batch, outputs=("log_probs", "routed_experts"))


def _train_delta(moe_dir, gc, routes_fn):
    from verl.workers.actor.ppo_actor import PolicyLoss

    engine, cfg = _engine(moe_dir, mode="R3", gc=gc, lr=1.0)
    batch = ragged_batch(n=4, seed=2)
    before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    data = DataProto.from_dict(tensors={**batch, "routed_experts": routes_fn(batch)},
                               meta_info={"temperature": 1.0, "micro_batch_size": 4})
    engine.train_batch(data, PolicyLoss(cfg.actor), outputs=("log_probs",))
    after = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    return {k: before[k] - after[k] for k in before}


def test_replay_holds_in_activation_checkpointing_recompute(gloo, moe_dir):
    """The update replays through backward: with gradient checkpointing the routers run again there and must
    take the same routes (else the gradients would be those of another routing)."""
    ref_routes = hf_topk(moe_dir, ragged_batch(n=4, seed=2))
    forced = lambda b: shifted(ref_routes).to(torch.int16)  # noqa: E731
    plain = _train_delta(moe_dir, False, forced)
    ckpt = _train_delta(moe_dir, True, forced)
    assert max(v.abs().max() for v in plain.values()) > 0
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-6, rtol=1e-4)
    own = _train_delta(moe_dir, False, lambda b: ref_routes.to(torch.int16))
    assert max((own[k] - plain[k]).abs().max() for k in plain) > 1e-6
