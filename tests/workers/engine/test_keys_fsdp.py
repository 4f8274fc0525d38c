"""Every role's FSDP engine section (``actor_rollout_ref.{actor,ref}.fsdp_config``, ``critic.fsdp`` and the SFT
trainer's ``engine``) reaches the engine it configures, on CPU with one gloo rank.

Each test composes the real config with the key changed, builds and initializes the role's engine the way
its worker does (``build_engine``; the SFT trainer's own construction for ``engine.*``) on a tiny checkpoint,
and checks the effect: the dtype of the weights, where optimizer state lives, which modules FSDP shards on
their own and how, the device mesh, the sequence-parallel size. The accelerator-only keys (compute dtype,
parameter offload) are in test_keys_fsdp_gpu.py. The key names are spelled out so key_status.txt can point
here.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_fsdp")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


def build(model_dir, key: str, value=None, *extra: str, initialize: bool = True):
    """The engine of the role ``key`` belongs to, from a config composed with ``key=value``."""
    from verl.trainer.config.checks import compose_config

    overrides = ([f"{key}={value}"] if value is not None else []) + list(extra)
    if key.startswith("engine."):
        from verl.workers.engine.fsdp.engine import FSDPEngine

        cfg = compose_config("sft_trainer_engine", [f"model.path={model_dir}", "model.enable_gradient_checkpointing=false",
                                                    *overrides], validate=False)
        OmegaConf.resolve(cfg)
        engine = FSDPEngine(model_config=cfg.model, engine_config=cfg.engine, optimizer_config=cfg.optim,
                            checkpoint_config=cfg.checkpoint, role="sft")
    else:
        from verl.workers.engine_workers import build_engine

        cfg = compose_config("ppo_trainer", [
            "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
            f"critic.model.path={model_dir}", "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "critic.model.enable_gradient_checkpointing=false", *overrides], validate=False)
        OmegaConf.resolve(cfg)
        if key.startswith("critic."):
            engine = build_engine(cfg.critic, cfg.critic.model, "critic", trainable=True)
        else:
            role = "ref" if key.startswith("actor_rollout_ref.ref.") else "actor"
            arr = cfg.actor_rollout_ref
            engine = build_engine(arr[role], arr.model, role, trainable=role != "ref")
    if initialize:
        engine.initialize()
    return engine


MODEL_DTYPE = ["actor_rollout_ref.actor.fsdp_config.model_dtype", "actor_rollout_ref.ref.fsdp_config.model_dtype",
               "critic.fsdp.model_dtype", "engine.model_dtype"]


@pytest.mark.parametrize("key", MODEL_DTYPE)
def test_model_dtype_is_the_dtype_of_the_weights(gloo, model_dir, key):
    assert {p.dtype for p in build(model_dir, key, "fp32").module.parameters()} == {torch.float32}
    assert {p.dtype for p in build(model_dir, key, "bf16").module.parameters()} == {torch.bfloat16}


OPTIMIZER_OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload", "critic.fsdp.optimizer_offload",
                     "engine.optimizer_offload"]


@pytest.mark.parametrize("key", OPTIMIZER_OFFLOAD)
def test_optimizer_offload_moves_state_around_the_step(gloo, model_dir, key, monkeypatch):
    from verl.workers.engine.fsdp.engine import FSDPEngine

    moves = []
    real = FSDPEngine.to
    monkeypatch.setattr(FSDPEngine, "to", lambda self, device, model=True, optimizer=True, grad=True: (
        moves.append((device, model, optimizer, grad)), real(self, device, model, optimizer, grad))[1])
    for value, expected in ((False, []), (True, [("device", False, True, False), ("cpu", False, True, False)])):
        engine = build(model_dir, key, value)
        moves.clear()
        loss = sum(p.float().sum() for p in engine.module.parameters())
        loss.backward()
        engine.optimizer_step()
        assert moves == expected, value


OFFLOAD_POLICY = ["actor_rollout_ref.actor.fsdp_config.offload_policy", "critic.fsdp.offload_policy",
                  "engine.offload_policy", "actor_rollout_ref.actor.fsdp_config.param_offload"]


@pytest.mark.parametrize("key", OFFLOAD_POLICY)
def test_cpu_offload_policy_leaves_the_optimizer_state_in_host_memory(gloo, model_dir, key, monkeypatch):
    """Under FSDP2's CPUOffloadPolicy (offload_policy, or param_offload) the parameters and so the optimizer step
    live on the host: optimizer_offload must not move the state to the device (the step would mix devices)."""
    from verl.workers.engine.fsdp.engine import FSDPEngine

    moves = []
    real = FSDPEngine.to
    monkeypatch.setattr(FSDPEngine, "to", lambda self, device, model=True, optimizer=True, grad=True: (
        moves.append(device), real(self, device, model, optimizer, grad))[1])
    section = key.rsplit(".", 1)[0]
    engine = build(model_dir, key, True, f"{section}.optimizer_offload=true")
    assert engine.cpu_offload_policy and not engine.offload_optimizer
    loss = sum(p.float().sum() for p in engine.module.parameters())
    loss.backward()
    engine.optimizer_step()
    assert moves == []
    assert not build(model_dir, key, False, f"{section}.optimizer_offload=true").cpu_offload_policy


def _shard_kwargs(model_dir, key, value, monkeypatch):
    import verl.utils.fsdp_utils as fsdp_utils

    seen = []
    real = fsdp_utils.fully_shard
    monkeypatch.setattr(fsdp_utils, "fully_shard", lambda module, **kw: (seen.append(kw), real(module, **kw))[1])
    build(model_dir, key, value)
    monkeypatch.setattr(fsdp_utils, "fully_shard", real)
    return seen


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
                                 "actor_rollout_ref.ref.fsdp_config.reshard_after_forward",
                                 "critic.fsdp.reshard_after_forward", "engine.reshard_after_forward"])
def test_reshard_after_forward_is_the_fsdp_setting(gloo, model_dir, key, monkeypatch):
    for value in (True, False):
        seen = _shard_kwargs(model_dir, key, value, monkeypatch)
        assert seen and {kw["reshard_after_forward"] for kw in seen} == {value}


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params",
                                 "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params",
                                 "critic.fsdp.wrap_policy.min_num_params", "engine.wrap_policy.min_num_params"])
def test_min_num_params_chooses_the_units_by_size(gloo, model_dir, key):
    def units(value):
        return len([m for m in build(model_dir, key, value).module.modules() if isinstance(m, FSDPModule)])

    per_layer = units(0)  # 0: one unit per decoder layer (plus embedding and root)
    assert units(10**12) == 1  # nothing reaches the threshold: only the root
    assert units(2000) > per_layer  # small blocks become units of their own


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap",
                                 "actor_rollout_ref.ref.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap",
                                 "critic.fsdp.wrap_policy.transformer_layer_cls_to_wrap",
                                 "engine.wrap_policy.transformer_layer_cls_to_wrap"])
def test_transformer_layer_cls_to_wrap_chooses_the_units_by_class(gloo, model_dir, key):
    """The classes named get their own unit (and nothing else below the root); settable with or without `+`
    (the key is null by default, as upstream's scripts add it with `+`)."""
    def wrapped(value, plus=""):
        from verl.models.transformers.patching import base_class

        engine = build(model_dir, key, None, *([f"{plus}{key}={value}"] if value else []))
        return sorted({base_class(m).__name__ for m in engine.module.modules() if isinstance(m, FSDPModule)
                       and m is not engine.module})

    assert wrapped("[Qwen3_5Attention]") == ["Qwen3_5Attention"]
    assert wrapped("[Qwen3_5GatedDeltaNet,Qwen3_5MLP]", plus="+") == ["Qwen3_5GatedDeltaNet", "Qwen3_5MLP"]
    assert "Qwen3_5DecoderLayer" in wrapped(None)  # null: the decoder layers


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.fsdp_size",
                                 "actor_rollout_ref.ref.fsdp_config.fsdp_size", "critic.fsdp.fsdp_size",
                                 "engine.fsdp_size"])
def test_fsdp_size_is_the_sharding_group_size(gloo, model_dir, key, monkeypatch):
    import verl.utils.fsdp_utils as fsdp_utils

    asked = []
    real = fsdp_utils.create_device_mesh
    monkeypatch.setattr(fsdp_utils, "create_device_mesh", lambda world, size, dev: (asked.append(size),
                                                                                    real(world, size, dev))[1])
    build(model_dir, key, 1)
    assert asked == [1]
    monkeypatch.setattr(fsdp_utils, "create_device_mesh", real)
    with pytest.raises(ValueError, match="fsdp_size=3 must divide the world size 4"):
        real(4, 3, "cpu")


def test_fsdp_size_makes_a_hybrid_mesh():
    """create_device_mesh with fsdp_size below the world: (replicas, shards), checked on a 4-rank fake group in a
    subprocess (torch's fake process group; no real communication)."""
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=4)\n"
        "from verl.utils.fsdp_utils import create_device_mesh\n"
        "m = create_device_mesh(4, 2, 'cpu'); print(m.mesh_dim_names, tuple(m.mesh.shape))\n"
        "m = create_device_mesh(4, -1, 'cpu'); print(m.mesh_dim_names, tuple(m.mesh.shape))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["('ddp', 'fsdp') (2, 2)", "('fsdp',) (4,)"]


def test_sft_engine_ulysses_sequence_parallel_size(model_dir):
    # the SFT engine has no role section: its sequence-parallel size is engine.ulysses_sequence_parallel_size
    engine = build(model_dir, "engine.ulysses_sequence_parallel_size", 2, initialize=False)
    assert engine.sp_size == 2
    assert build(model_dir, "engine.ulysses_sequence_parallel_size", 1, initialize=False).sp_size == 1


def test_sft_engine_strategy_picks_the_engine(tmp_path):
    from verl.trainer.sft_trainer import compose_sft_config
    from verl.workers.engine import EngineRegistry

    _, strategy = compose_sft_config([f"model.path={tmp_path}", "engine.strategy=fsdp2"])
    assert strategy == "fsdp2" and EngineRegistry.get_or_raise(strategy).__name__ == "FSDPEngine"
    _, strategy = compose_sft_config([f"model.path={tmp_path}", "engine.strategy=megatron"])
    assert strategy == "megatron"  # the Megatron engine (which needs megatron-core) is what the trainer builds


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.strategy", "critic.strategy"])
def test_role_strategy_picks_the_engine(model_dir, key):
    from verl.workers.engine.fsdp.engine import FSDPEngine

    assert isinstance(build(model_dir, key, "fsdp2", initialize=False), FSDPEngine)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="mcore"):  # the Megatron engine, which names its extra
            build(model_dir, key, "megatron", initialize=False)


def test_actor_entropy_chunking_keys_reach_the_engine(gloo, model_dir, monkeypatch):
    import torch.utils.checkpoint as ckpt_mod

    from tests.engine_utils import sgd
    from verl.utils import torch_functional as verl_F
    from verl.protocol import DataProto
    from verl.workers.actor.ppo_actor import PolicyLoss

    def entropy_and_grad(*extra):
        engine = build(model_dir, "actor_rollout_ref.actor.entropy_coeff", 0.1, *extra, initialize=False)
        sgd(engine.role_config)
        engine.initialize()
        torch.manual_seed(0)
        n, prompt, response = 4, 5, 4
        ids = torch.randint(10, 100, (n, prompt + response))
        mask = torch.ones_like(ids)
        data = DataProto.from_dict(tensors={
            "input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1, "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:], "old_log_probs": torch.zeros(n, response),
            "advantages": torch.ones(n, response)}, meta_info={"temperature": 1.0, "micro_batch_size": 2})
        m = engine.train_batch(data, PolicyLoss(engine.role_config), outputs=("log_probs", "entropy"))
        return m["actor/entropy"], m["grad_norm"], engine

    chunks, checkpoints = [], []
    real_chunked, real_ckpt = verl_F.entropy_from_logits_with_chunking, ckpt_mod.checkpoint
    monkeypatch.setattr(verl_F, "entropy_from_logits_with_chunking",
                        lambda logits, size: (chunks.append(size), real_chunked(logits, size))[1])
    monkeypatch.setattr(ckpt_mod, "checkpoint", lambda *a, **kw: (checkpoints.append(1), real_ckpt(*a, **kw))[1])
    base = entropy_and_grad()
    assert chunks == [] and checkpoints == []
    chunked = entropy_and_grad("actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
                               "actor_rollout_ref.actor.entropy_from_logits_chunk_size=3")
    assert set(chunks) == {3} and checkpoints == []  # the chunked helper ran, with the actor's chunk size
    assert chunked[0] == pytest.approx(base[0], rel=1e-5) and chunked[1] == pytest.approx(base[1], rel=1e-5)
    ckpt = entropy_and_grad("actor_rollout_ref.actor.entropy_checkpointing=true")
    assert checkpoints  # entropy recomputed in backward
    assert ckpt[0] == pytest.approx(base[0], rel=1e-5) and ckpt[1] == pytest.approx(base[1], rel=1e-5)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.checkpoint.save_contents", "critic.checkpoint.save_contents",
                                 "checkpoint.save_contents"])
def test_save_contents_chooses_what_a_checkpoint_holds(gloo, model_dir, key, tmp_path):
    # (checkpoint.* is the SFT trainer's section; build() reads it for the engine.* role)
    probe = "engine.seed" if key.startswith("checkpoint.") else key
    e = build(model_dir, probe, None, f"{key}=[model]")
    e.save_checkpoint(str(tmp_path / "a"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix == ".pt") == ["model_world_size_1_rank_0.pt"]
    e = build(model_dir, probe, None, f"{key}=[model,optimizer,extra,hf_model]")
    e.save_checkpoint(str(tmp_path / "b"))
    names = {p.name for p in (tmp_path / "b").iterdir()}
    assert {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt", "extra_state_world_size_1_rank_0.pt"} <= names
    assert (tmp_path / "b" / "huggingface" / "config.json").exists()


def test_sft_load_contents_chooses_what_a_resume_restores(gloo, model_dir, tmp_path):
    def stepped(*extra):
        e = build(model_dir, "engine.seed", None, *extra)
        sum(p.float().sum() for p in e.module.parameters()).backward()
        e.optimizer_step()  # the optimizer now has state (Adam moments)
        return e

    stepped().save_checkpoint(str(tmp_path / "ckpt"))
    full = build(model_dir, "engine.seed", None)
    full.load_checkpoint(str(tmp_path / "ckpt"))
    assert len(full.optimizer.state) > 0
    model_only = build(model_dir, "engine.seed", None, "checkpoint.load_contents=[model]")
    model_only.load_checkpoint(str(tmp_path / "ckpt"))
    assert len(model_only.optimizer.state) == 0
