"""Multi-token prediction (``model.mtp``) on the FSDP engine, one gloo rank on CPU: the checkpoint's ``mtp.*``
head is loaded (or its absence named), its loss matches an independent per-sequence computation through the
stock HF modules, its gradients reach the MTP weights (and, with ``detach_encoder``, nothing else), the base
path is untouched without ``enable_train``, and checkpoints / HF exports keep the head."""

import os

import pytest
import torch
from omegaconf import open_dict
from safetensors.torch import load_file, save_file

from tests.engine_utils import arr_config, make_engine, sgd
from verl.protocol import DataProto


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("mtp_dense")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0, mtp_num_hidden_layers=1)
    return str(path)


def mtp_cfg(model_dir, enable=True, train=True, detach=False, scale=0.1, extra=()):
    return arr_config(model_dir, [f"actor_rollout_ref.model.mtp.enable={enable}",
                                  f"actor_rollout_ref.model.mtp.enable_train={train}",
                                  f"actor_rollout_ref.model.mtp.detach_encoder={detach}",
                                  f"actor_rollout_ref.model.mtp.mtp_loss_scaling_factor={scale}", *extra])


def sft_batch(n=5, length=12, vocab=100, seed=1):
    """Right-padded rows with a loss mask over a suffix (the SFT layout: a full-length ``loss_mask``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    loss = torch.zeros(n, length, dtype=torch.long)
    for i in range(n):
        real = length - (i % 3)
        mask[i, real:] = 0
        loss[i, 3 + (i % 2):real] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "loss_mask": loss}


def run_sft_step(engine, batch, micro=2):
    from verl.trainer.sft.loss import make_sft_loss

    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "micro_batch_size": micro})
    loss_fn = make_sft_loss(int(batch["loss_mask"][:, 1:].sum()), 1)
    return engine.train_batch(data, loss_fn)


def reference_mtp_ce(model_dir, batch):
    """Mean CE of the MTP head over the targets, per sequence through the stock HF modules (an explicit causal
    mask, transformers' own decoder layer forward, the checkpoint's tensors read straight from the file)."""
    from transformers import AutoModelForCausalLM

    from verl.models.qwen3_5.mtp import Qwen3_5MTP, read_mtp_state_dict
    from verl.models.transformers.patching import modeling_module

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = Qwen3_5MTP(model.model.config, modeling_module(model.model))
    head.load_state_dict(read_mtp_state_dict(model_dir))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(batch["input_ids"])):
            real = batch["attention_mask"][i].nonzero().squeeze(-1)
            ids = batch["input_ids"][i, real][None]
            tgt_mask = batch["loss_mask"][i, real]
            t = ids.shape[1]
            hidden = model.model(input_ids=ids).last_hidden_state  # post final norm
            emb = model.model.embed_tokens(ids[:, 1:])  # token t+1 for positions 0..t-2
            h = hidden[:, :-1]
            x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(h)], -1))
            pos = torch.arange(t - 1)[None]
            pe = model.model.rotary_emb(x, pos)
            causal = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None]
            layer = head.layers[0]
            x = type(layer).forward(layer, x, position_embeddings=pe, attention_mask=causal)
            x = x[0] if isinstance(x, tuple) else x
            logits = model.lm_head(head.norm(x))[0, :-1]  # position p predicts token p + 2
            labels = ids[0, 2:]
            keep = tgt_mask[2:].bool()
            ce = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
            total += float(ce)
            count += int(keep.sum())
    return total / count


def test_load_attaches_the_checkpoint_mtp_head(gloo, mtp_dir):
    cfg = mtp_cfg(mtp_dir, train=False)
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    state = {k: v.full_tensor() for k, v in engine.module.state_dict().items() if k.startswith("mtp.")}
    on_disk = {k: v for k, v in load_file(os.path.join(mtp_dir, "model.safetensors")).items() if k.startswith("mtp.")}
    assert set(state) == set(on_disk) and "mtp.fc.weight" in state and "mtp.pre_fc_norm_hidden.weight" in state
    for k in on_disk:
        torch.testing.assert_close(state[k], on_disk[k], atol=0, rtol=0)
    # The reference policy never carries the head (upstream forces its MTP off).
    ref = make_engine(cfg.ref, cfg.model, role="ref")
    assert not any(k.startswith("mtp.") for k in ref.module.state_dict())


def test_mtp_disabled_drops_the_head(gloo, mtp_dir):
    cfg = mtp_cfg(mtp_dir, enable=False, train=False)
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    assert not any(k.startswith("mtp.") for k in engine.module.state_dict())


def test_missing_mtp_weights_are_named(gloo, mtp_dir, tmp_path):
    import shutil

    for name in os.listdir(mtp_dir):
        shutil.copy(os.path.join(mtp_dir, name), tmp_path / name)
    sd = load_file(os.path.join(mtp_dir, "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "mtp.fc.weight"}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = mtp_cfg(str(tmp_path), train=False)
    with pytest.raises(ValueError, match=r"mtp\.enable.*missing 1: mtp\.fc\.weight"):
        make_engine(cfg.actor, cfg.model, role="actor")


def test_checkpoint_without_mtp_layers_is_an_error(gloo, tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    build_tiny_qwen3_5(str(tmp_path), kind="dense", seed=0)
    cfg = mtp_cfg(str(tmp_path), train=False)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.mtp.enable=true.*mtp_num_hidden_layers"):
        make_engine(cfg.actor, cfg.model, role="actor")


@pytest.mark.parametrize("rmpad, gc", [(True, False), (False, False), (True, True)])
def test_mtp_loss_matches_per_sequence_reference(gloo, mtp_dir, rmpad, gc):
    cfg = mtp_cfg(mtp_dir, extra=[f"actor_rollout_ref.model.use_remove_padding={rmpad}"])
    with open_dict(cfg.model):  # gradient checkpointing re-runs the layers in backward: the hooks must not
        cfg.model.enable_gradient_checkpointing = gc
    engine = make_engine(sgd(cfg.actor, lr=0.0), cfg.model, role="actor")
    assert engine.use_remove_padding == rmpad
    batch = sft_batch()
    metrics = run_sft_step(engine, batch)
    want = reference_mtp_ce(mtp_dir, batch)
    assert metrics["mtp_losses/mtp_1_loss"] == pytest.approx(want, rel=1e-4, abs=1e-5)


def _deltas(model_dir, batch, **kw):
    cfg = mtp_cfg(model_dir, **kw)
    engine = make_engine(sgd(cfg.actor, lr=1.0), cfg.model, role="actor")
    with open_dict(cfg.actor):
        cfg.actor.optim.clip_grad = 1e9  # compare raw gradients, no clipping
    before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}
    metrics = run_sft_step(engine, batch)
    after = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    return metrics, {k: after[k] - before[k] for k in before}


def test_gradients_reach_the_mtp_head(gloo, mtp_dir):
    batch = sft_batch()
    off_metrics, off = _deltas(mtp_dir, batch, train=False)
    assert not any(k.startswith("mtp_losses/") for k in off_metrics)
    assert all(float(d.abs().max()) == 0.0 for k, d in off.items() if k.startswith("mtp."))  # no loss, no update
    on_metrics, on = _deltas(mtp_dir, batch, train=True)
    assert on_metrics["mtp_losses/mtp_1_loss"] > 0
    for k in ("mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
              "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
        assert float(on[k].abs().max()) > 0, k
    base = [k for k in off if not k.startswith("mtp.")]
    # Without detach_encoder the MTP loss also trains the main model (through its hidden states).
    assert any(not torch.allclose(on[k], off[k], atol=1e-9) for k in base)


def test_detach_encoder_isolates_the_head_and_the_factor_scales_it(gloo, mtp_dir):
    batch = sft_batch()
    _, off = _deltas(mtp_dir, batch, train=False)
    _, on = _deltas(mtp_dir, batch, train=True)
    base = [k for k in off if not k.startswith("mtp.")]
    _, detached = _deltas(mtp_dir, batch, train=True, detach=True)
    for k in base:  # detach_encoder: the main model sees exactly the base loss's gradient
        torch.testing.assert_close(detached[k], off[k], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(detached["mtp.fc.weight"], on["mtp.fc.weight"], atol=1e-7, rtol=1e-5)
    # The loss enters scaled by mtp_loss_scaling_factor: twice the factor, twice the head's update (SGD).
    _, double = _deltas(mtp_dir, batch, train=True, detach=True, scale=0.2)
    torch.testing.assert_close(double["mtp.fc.weight"], 2 * detached["mtp.fc.weight"], atol=1e-7, rtol=1e-4)


def test_base_path_unchanged_without_enable_train(gloo, mtp_dir):
    from tests.engine_utils import ragged_batch
    from verl.workers.actor.ppo_actor import PolicyLoss

    results = []
    for enable in (False, True):
        cfg = mtp_cfg(mtp_dir, enable=enable, train=False)
        engine = make_engine(sgd(cfg.actor, lr=1.0), cfg.model, role="actor")
        data = DataProto.from_dict(tensors=ragged_batch(n=4), meta_info={"temperature": 1.0, "micro_batch_size": 2})
        before = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items() if not k.startswith("mtp.")}
        metrics = engine.train_batch(data, PolicyLoss(cfg.actor))
        after = {k: v.full_tensor() for k, v in engine.module.state_dict().items() if not k.startswith("mtp.")}
        results.append((metrics, {k: after[k] - before[k] for k in before}))
    (m0, d0), (m1, d1) = results
    assert m0 == pytest.approx(m1) and set(d0) == set(d1)
    for k in d0:
        torch.testing.assert_close(d0[k], d1[k], atol=0, rtol=0)


def test_rl_metric_name_and_response_targets(gloo, mtp_dir):
    """RL: the actor logs upstream's actor/mtp_losses/mtp_1_loss; targets are the response tokens."""
    from tests.engine_utils import ragged_batch
    from verl.workers.actor.ppo_actor import PPOActor

    cfg = mtp_cfg(mtp_dir)
    engine = make_engine(sgd(cfg.actor, lr=0.0), cfg.model, role="actor")
    batch = ragged_batch(n=4)
    actor = PPOActor(cfg.actor, engine)
    with open_dict(cfg.actor):
        cfg.actor.ppo_mini_batch_size = 4
        cfg.actor.ppo_micro_batch_size_per_gpu = 2
        cfg.actor.ppo_epochs = 1
    metrics = actor.update_policy(DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0}))
    got = metrics["actor/mtp_losses/mtp_1_loss"][0]
    prompt = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    loss_mask = torch.zeros_like(batch["attention_mask"])
    loss_mask[:, prompt:] = batch["response_mask"]
    want = reference_mtp_ce(mtp_dir, {**batch, "loss_mask": loss_mask})
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_checkpoint_and_hf_export_keep_the_head(gloo, mtp_dir, tmp_path):
    cfg = mtp_cfg(mtp_dir, extra=["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    engine = make_engine(sgd(cfg.actor, lr=1.0), cfg.model, role="actor")
    run_sft_step(engine, sft_batch())
    trained = {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items() if k.startswith("mtp.")}
    on_disk = load_file(os.path.join(mtp_dir, "model.safetensors"))
    assert not torch.equal(trained["mtp.fc.weight"], on_disk["mtp.fc.weight"])
    engine.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    # Trainer checkpoint: a fresh engine from the original weights, then the checkpoint loaded over it.
    fresh = make_engine(sgd(mtp_cfg(mtp_dir).actor, lr=1.0), cfg.model, role="actor")
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    for k, v in fresh.module.state_dict().items():
        if k.startswith("mtp."):
            torch.testing.assert_close(v.full_tensor(), trained[k], atol=0, rtol=0)
    # HF export: the trained head is in the safetensors under its checkpoint names, and loads back.
    hf_dir = next(os.path.join(r, "") for r, _, files in os.walk(tmp_path / "ckpt") if "model.safetensors" in files)
    exported = load_file(os.path.join(hf_dir, "model.safetensors"))
    for k in trained:
        torch.testing.assert_close(exported[k], trained[k], atol=0, rtol=0)
    reloaded_cfg = mtp_cfg(hf_dir, train=False)
    reloaded = make_engine(reloaded_cfg.actor, reloaded_cfg.model, role="actor")
    for k, v in reloaded.module.state_dict().items():
        if k.startswith("mtp."):
            torch.testing.assert_close(v.full_tensor(), trained[k], atol=0, rtol=0)


def test_rollout_weights_leave_the_head_out(gloo, mtp_dir):
    """Without mtp.enable_rollout no rollout engine drafts with the MTP head, so weight sync never sends it."""
    cfg = mtp_cfg(mtp_dir, train=False)
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    names = [n for n, _ in engine.get_rollout_weights()[0]]
    assert names and not any(n.startswith("mtp.") for n in names)


def test_rollout_weights_carry_the_head_for_speculative_decoding(gloo, mtp_dir):
    """With actor_rollout_ref.model.mtp.enable_rollout=true the rollout drafts with the head: the weight sync
    sends its tensors after each update (a rollout pool's own copy, role 'rollout', loads them by name), and a
    rollout pool's policy copy carries the head although it does not train."""
    cfg = mtp_cfg(mtp_dir, train=True, extra=["actor_rollout_ref.model.mtp.enable_rollout=true"])
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    sent = dict(engine.get_rollout_weights()[0])
    expected = {k for k in engine.module.state_dict() if k.startswith("mtp.")}
    assert expected and expected <= set(sent)
    pool = make_engine(cfg.actor, cfg.model, role="rollout")
    assert hasattr(pool.module, "mtp") and pool.mtp_runner is None  # carried for drafting, no MTP loss
    from verl.workers.weight_sync.receive import load_hf_weights

    assert load_hf_weights(pool.module, engine.get_rollout_weights()[0]) == len(sent)  # every name, the head's too


def test_moe_checkpoint_per_expert_mtp_tensors_are_fused_on_load(gloo, tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    build_tiny_qwen3_5(str(tmp_path), kind="moe", seed=0, mtp_num_hidden_layers=1)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in on_disk  # the checkpoint format: per expert
    cfg = mtp_cfg(str(tmp_path), train=False)
    engine = make_engine(cfg.actor, cfg.model, role="actor")
    sd = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    gate_up = sd["mtp.layers.0.mlp.experts.gate_up_proj"]
    inter = on_disk["mtp.layers.0.mlp.experts.1.gate_proj.weight"].shape[0]
    torch.testing.assert_close(gate_up[1, :inter], on_disk["mtp.layers.0.mlp.experts.1.gate_proj.weight"])
    torch.testing.assert_close(gate_up[1, inter:], on_disk["mtp.layers.0.mlp.experts.1.up_proj.weight"])
    torch.testing.assert_close(sd["mtp.layers.0.mlp.experts.down_proj"][2],
                               on_disk["mtp.layers.0.mlp.experts.2.down_proj.weight"])
