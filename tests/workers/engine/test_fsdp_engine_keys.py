"""FSDP keys that used to be accepted and ignored now do what upstream's do (one gloo rank, CPU):
fsdp_config.optimizer_offload / model_dtype / wrap_policy / use_torch_compile, model.enable_activation_offload /
external_lib / use_liger, optim.optimizer."""

import sys

import pytest
import torch
from omegaconf import open_dict
from torch.distributed.fsdp import FSDPModule

from tests.engine_utils import arr_config, make_engine, sgd
from verl.protocol import DataProto


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_dense")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


def _batch(n=4, seq=9, response=4, seed=0):
    from tests.engine_utils import ragged_batch

    return DataProto.from_dict(tensors=ragged_batch(n=n, prompt=seq - response, response=response, seed=seed),
                               meta_info={"temperature": 1.0, "micro_batch_size": 2})


def _loss(cfg):
    from verl.workers.actor.ppo_actor import PolicyLoss

    return PolicyLoss(cfg.actor)


def _params(engine):
    return {k: v.full_tensor().clone() for k, v in engine.module.state_dict().items()}


def _step(model_dir, overrides=(), **fsdp_keys):
    cfg = arr_config(model_dir, overrides)
    with open_dict(cfg.actor):
        for k, v in fsdp_keys.items():
            cfg.actor.fsdp_config[k] = v
    engine = make_engine(cfg.actor, cfg.model, "actor")
    metrics = engine.train_batch(_batch(), _loss(cfg), outputs=("log_probs", "entropy"))
    return engine, metrics


# ------------------------------------------------------------------------------ fsdp_config.optimizer_offload
def test_optimizer_offload_keeps_state_on_cpu_between_steps_and_trains_the_same(gloo, model_dir, monkeypatch):
    from verl.workers.engine.fsdp.engine import FSDPEngine

    moves = []
    original = FSDPEngine.to

    def spy(self, device, model=True, optimizer=True, grad=True):
        moves.append((device, model, optimizer, grad))
        return original(self, device, model, optimizer, grad)

    monkeypatch.setattr(FSDPEngine, "to", spy)
    off, m_off = _step(model_dir, optimizer_offload=True)
    # loaded to the device for the step, back to CPU after it
    assert moves[-2:] == [("device", False, True, False), ("cpu", False, True, False)]
    for state in off.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    moves.clear()
    on, m_on = _step(model_dir, optimizer_offload=False)
    assert moves == []
    assert m_off["grad_norm"] == pytest.approx(m_on["grad_norm"], rel=1e-6)
    p_off, p_on = _params(off), _params(on)
    for k in p_on:
        assert torch.equal(p_off[k], p_on[k]), k


# ------------------------------------------------------------------------------ fsdp_config.model_dtype
def test_model_dtype_sets_the_dtype_weights_are_loaded_in(gloo, model_dir):
    cfg = arr_config(model_dir)
    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.model_dtype = "bf16"
    engine = make_engine(cfg.ref, cfg.model, "ref")
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    out = engine.infer_batch(_batch())
    assert torch.isfinite(out["log_probs"]).all()
    fp32 = make_engine(arr_config(model_dir).ref, cfg.model, "ref")
    assert {p.dtype for p in fp32.module.parameters()} == {torch.float32}
    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.model_dtype = "fp8"
    with pytest.raises(ValueError, match="fsdp_config.model_dtype='fp8'"):
        make_engine(cfg.ref, cfg.model, "ref")


# ------------------------------------------------------------------------------ fsdp_config.wrap_policy
def _units(engine):
    return [m for m in engine.module.modules() if isinstance(m, FSDPModule)]


def test_wrap_policy_decides_which_modules_are_sharded_on_their_own(gloo, model_dir):
    cfg = arr_config(model_dir)
    default = make_engine(cfg.ref, cfg.model, "ref")
    layers = [m for m in _units(default) if type(m).__name__.startswith("FSDPQwen3_5DecoderLayer")]
    n_layers = default.module.config.num_hidden_layers
    assert len(layers) == n_layers

    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.wrap_policy = {"transformer_layer_cls_to_wrap": ["Qwen3_5GatedDeltaNet"]}
    by_class = make_engine(cfg.ref, cfg.model, "ref")
    names = {type(m).__name__ for m in _units(by_class)}
    assert "FSDPQwen3_5GatedDeltaNet" in names and "FSDPQwen3_5DecoderLayer" not in names

    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.wrap_policy = {"min_num_params": 10**12}
    by_size = make_engine(cfg.ref, cfg.model, "ref")
    assert len(_units(by_size)) == 1  # nothing reaches the threshold: the root is the only unit
    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.wrap_policy = {"min_num_params": 2000}
    small = make_engine(cfg.ref, cfg.model, "ref")
    assert len(_units(small)) > n_layers + 1
    # the forward is the same whatever the units
    data = _batch()
    ref = default.infer_batch(data)["log_probs"]
    for e in (by_class, by_size, small):
        torch.testing.assert_close(e.infer_batch(data)["log_probs"], ref)

    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.wrap_policy = {"transformer_layer_cls_to_wrap": ["NoSuchLayer"]}
    with pytest.raises(ValueError, match="transformer_layer_cls_to_wrap"):
        make_engine(cfg.ref, cfg.model, "ref")


# ------------------------------------------------------------------------------ fsdp_config.use_torch_compile
def test_use_torch_compile_compiles_the_entropy_helper_on_accelerators(gloo, model_dir, monkeypatch):
    from verl.workers.engine.fsdp import compile as compile_mod

    cfg = arr_config(model_dir)
    eager = make_engine(cfg.ref, cfg.model, "ref")
    assert not getattr(eager._entropy_fn, "_verl_compiled", False)  # CPU: not compiled (logged once)
    # As on an accelerator, but with the eager backend so the test needs no C++ toolchain.
    monkeypatch.setattr(compile_mod, "get_device_name", lambda: "cuda")
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    compiled = make_engine(cfg.ref, cfg.model, "ref")
    assert getattr(compiled._entropy_fn, "_verl_compiled", False)
    with open_dict(cfg.ref):
        cfg.ref.fsdp_config.use_torch_compile = False
    assert not getattr(make_engine(cfg.ref, cfg.model, "ref")._entropy_fn, "_verl_compiled", False)
    data = _batch()
    a = eager.infer_batch(data, outputs=("log_probs", "entropy"))
    b = compiled.infer_batch(data, outputs=("log_probs", "entropy"))
    torch.testing.assert_close(a["entropy"], b["entropy"])


# ------------------------------------------------------------------------------ model.enable_activation_offload
def test_activation_offload_saves_activations_on_cpu_and_keeps_gradients(gloo, model_dir, monkeypatch):
    entered = []
    real = torch.autograd.graph.save_on_cpu

    class Spy(real):
        def __init__(self, *a, **kw):
            entered.append(kw)
            super().__init__(*a, **kw)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    cfg = arr_config(model_dir, ["actor_rollout_ref.model.enable_activation_offload=true"])
    off = make_engine(sgd(cfg.actor), cfg.model, "actor")
    m_off = off.train_batch(_batch(), _loss(cfg))
    assert len(entered) == 2  # one per micro-batch of the training pass
    off.infer_batch(_batch())
    assert len(entered) == 2  # not for inference
    cfg2 = arr_config(model_dir)
    on = make_engine(sgd(cfg2.actor), cfg2.model, "actor")
    m_on = on.train_batch(_batch(), _loss(cfg2))
    assert m_off["grad_norm"] == pytest.approx(m_on["grad_norm"], rel=1e-6)


# ------------------------------------------------------------------------------ model.external_lib
def test_external_lib_is_imported_before_the_model_is_built(gloo, model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_custom_models.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = arr_config(model_dir, ["actor_rollout_ref.model.external_lib=my_custom_models"])
    make_engine(cfg.ref, cfg.model, "ref")
    assert sys.modules["my_custom_models"].IMPORTED
    bad = arr_config(model_dir, ["actor_rollout_ref.model.external_lib=no_such_module_xyz"])
    with pytest.raises(ImportError, match="model.external_lib='no_such_module_xyz'"):
        make_engine(bad.ref, bad.model, "ref")


# ------------------------------------------------------------------------------ model.use_liger
def test_use_liger_needs_liger_kernel_and_then_applies_it(gloo, model_dir, monkeypatch):
    import types

    cfg = arr_config(model_dir, ["actor_rollout_ref.model.use_liger=true"])
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable
    with pytest.raises(ImportError, match="model.use_liger=true needs the liger-kernel package"):
        make_engine(cfg.ref, cfg.model, "ref")
    applied = []
    fake_pkg = types.ModuleType("liger_kernel")
    fake_tr = types.ModuleType("liger_kernel.transformers")
    fake_mp = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake_mp._apply_liger_kernel_to_instance = lambda model: applied.append(type(model).__name__)
    for name, mod in (("liger_kernel", fake_pkg), ("liger_kernel.transformers", fake_tr),
                      ("liger_kernel.transformers.monkey_patch", fake_mp)):
        monkeypatch.setitem(sys.modules, name, mod)
    make_engine(cfg.ref, cfg.model, "ref")
    assert applied == ["Qwen3_5ForCausalLM"]


# ------------------------------------------------------------------------------ optim.optimizer / clip
def test_optimizer_class_comes_from_the_config(gloo, model_dir):
    cfg = arr_config(model_dir)
    assert type(make_engine(cfg.actor, cfg.model, "actor").optimizer).__name__ == "AdamW"
    assert type(make_engine(sgd(cfg.actor), cfg.model, "actor").optimizer).__name__ == "SGD"
    with open_dict(cfg.actor):
        cfg.actor.optim.optimizer = "NoSuchOpt"
    with pytest.raises(ValueError, match="optim.optimizer='NoSuchOpt'"):
        make_engine(cfg.actor, cfg.model, "actor")


def test_clip_grad_and_its_legacy_name(gloo, model_dir):
    cfg = arr_config(model_dir)
    with open_dict(cfg.actor):
        cfg.actor.optim.clip_grad = 0.5
    engine = make_engine(cfg.actor, cfg.model, "actor")
    assert engine._clip_grad() == 0.5
    with open_dict(cfg.actor):
        cfg.actor.optim.clip_grad = 1.0
        cfg.actor.grad_clip = 0.25
    assert engine._clip_grad() == 0.25
    with open_dict(cfg.actor):
        cfg.actor.optim.clip_grad = 0.5
    with pytest.raises(ValueError, match="disagree"):
        engine._clip_grad()


def test_role_use_torch_compile_false_also_turns_it_off(gloo, model_dir, monkeypatch):
    from verl.workers.engine.fsdp import compile as compile_mod

    monkeypatch.setattr(compile_mod, "get_device_name", lambda: "cuda")
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    cfg = arr_config(model_dir, ["actor_rollout_ref.actor.use_torch_compile=false"])
    assert not getattr(make_engine(cfg.actor, cfg.model, "actor")._entropy_fn, "_verl_compiled", False)


# ------------------------------------------------------------------------------ entropy chunking / checkpointing
def test_entropy_chunking_and_checkpointing_give_the_same_entropy_and_gradients(gloo, model_dir):
    def grads(**keys):
        cfg = arr_config(model_dir)
        with open_dict(cfg.actor):
            for k, v in keys.items():
                cfg.actor.fsdp_config[k] = v
            cfg.actor.entropy_coeff = 0.1
        engine = make_engine(sgd(cfg.actor), cfg.model, "actor")
        m = engine.train_batch(_batch(), _loss(cfg), outputs=("log_probs", "entropy"))
        return m["actor/entropy"], m["grad_norm"]

    base = grads()
    for keys in ({"entropy_from_logits_with_chunking": True, "entropy_from_logits_chunk_size": 5},
                 {"entropy_checkpointing": True}):
        ent, gn = grads(**keys)
        assert ent == pytest.approx(base[0], rel=1e-5) and gn == pytest.approx(base[1], rel=1e-5), keys
