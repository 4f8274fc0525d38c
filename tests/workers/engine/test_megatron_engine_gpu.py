"""MegatronEngine on one GPU with a stand-in GPTModel (see megatron_standin.py): log-probs against a direct
computation, offload -> reload -> train step equal to no offload, exact checkpoint resume, non-finite skip.

Run: ``pytest -m gpu tests/workers/engine/test_megatron_engine_gpu.py`` (megatron-core + CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

from omegaconf import OmegaConf  # noqa: E402

import megatron_standin  # noqa: E402  (rootdir-relative import, like tests/models)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    undo = megatron_standin.install()
    yield megatron_standin.write_hf_config(str(tmp_path_factory.mktemp("standin")))
    undo()


def make_engine(hf_path, dtype="float32", role="actor", **engine_kw):
    from verl.workers.engine.megatron import MegatronEngine

    torch.manual_seed(0)
    engine_cfg = OmegaConf.create({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                   "use_remove_padding": False, "dtype": dtype, "seed": 7,
                                   "override_transformer_config": {"recompute_granularity": None}, **engine_kw})
    optim = OmegaConf.create({"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.0, "total_training_steps": 10})
    eng = MegatronEngine(OmegaConf.create({"path": hf_path}), engine_cfg, optim,
                         OmegaConf.create({"save_contents": ["model", "optimizer", "extra"]}), role=role)
    eng.initialize()
    return eng


batch, nll_loss, flat_params = megatron_standin.batch, megatron_standin.nll_loss, megatron_standin.flat_params


def test_log_probs_match_direct_computation(hf_path):
    eng = make_engine(hf_path)
    data = batch()
    out = eng.infer_batch(data, outputs=("log_probs", "entropy"))
    model = eng.model[0].module
    fwd = megatron_standin._forward
    with torch.no_grad():
        dev = torch.device("cuda")
        logits = fwd(model, data.batch["input_ids"].to(dev), data.batch["position_ids"].to(dev),
                     attention_mask=data.batch["attention_mask"].to(dev)).float()
        logp = torch.log_softmax(logits, -1)
        ref = logp[:, :-1].gather(-1, data.batch["input_ids"][:, 1:].to(dev).unsqueeze(-1)).squeeze(-1).cpu()
        ent = -(logp.exp() * logp).sum(-1)[:, :-1].cpu()
    mask = (data.batch["attention_mask"][:, 1:] * data.batch["attention_mask"][:, :-1]).bool()
    err = (out["log_probs"][:, :-1] - ref)[mask].abs().max().item()
    err_e = (out["entropy"][:, :-1] - ent)[mask].abs().max().item()
    print(f"[megatron] stand-in log-prob max |diff| {err:.2e}, entropy {err_e:.2e} (fp32)")
    assert err < 1e-4 and err_e < 1e-4


def test_offload_reload_train_step_equals_no_offload(hf_path):
    plain = make_engine(hf_path, dtype="bfloat16")
    off = make_engine(hf_path, dtype="bfloat16", param_offload=True, grad_offload=True, optimizer_offload=True)
    # Offloaded storage is freed in place: parameters must not be read until they are reloaded.
    assert not off._resident["model"] and not off._resident["grad"] and not off._resident["optimizer"]
    off.to("device")
    assert torch.equal(flat_params(plain), flat_params(off))
    off.to("cpu")
    norms = []
    for step in range(3):
        data = batch(seed=step)
        m1 = plain.train_batch(data, nll_loss)
        m2 = off.train_batch(data, nll_loss)
        norms.append((m1["grad_norm"], m2["grad_norm"]))
        off.to("device")  # a full reload / offload cycle between steps as well
        off.to("cpu")
    print(f"[megatron] offload grad norms {norms}")
    for a, b in norms:
        assert a == b
    off.to("device")
    assert torch.equal(flat_params(plain), flat_params(off))


def test_checkpoint_resume_is_exact(hf_path, tmp_path):
    a = make_engine(hf_path, dtype="bfloat16")
    a.train_batch(batch(seed=1), nll_loss)
    a.lr_scheduler_step()
    a.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    m_a = a.train_batch(batch(seed=2), nll_loss)
    b = make_engine(hf_path, dtype="bfloat16")
    b.train_batch(batch(seed=9), nll_loss)  # diverge first, so the load has something to undo
    b.load_checkpoint(str(tmp_path / "ckpt"))
    m_b = b.train_batch(batch(seed=2), nll_loss)
    assert m_a["grad_norm"] == m_b["grad_norm"]
    assert torch.equal(flat_params(a), flat_params(b))


def test_non_finite_gradients_skip_the_step(hf_path):
    eng = make_engine(hf_path, dtype="bfloat16")
    before = flat_params(eng)

    def bad_loss(outs, mb):
        loss, m = nll_loss(outs, mb)
        return loss * float("nan"), m

    metrics = eng.train_batch(batch(), bad_loss)
    assert metrics["grad_norm"] != metrics["grad_norm"]  # nan
    assert torch.equal(before, flat_params(eng))
