"""The ``model`` sections of the actor (``actor_rollout_ref.model``), critic (``critic.model``) and SFT
trainer (``model``) shape the model, tokenizer and LoRA adapter the roles build, on CPU with one gloo rank.

Each test composes the real config with the key changed and builds what the role builds: the engine
(``build_engine``, or the SFT trainer's construction), the tokenizer (``load_tokenizer_and_processor``), the
model directory (``local_model_path``). The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf



@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_model_dense")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_model_moe")
    build_tiny_qwen3_5(str(path), kind="moe", seed=0)
    return str(path)


def section(model_dir, key, value=None, *extra):
    """(role, role section, model section) of a config composed with ``key=value``."""
    from verl.trainer.config.checks import compose_config

    overrides = ([f"{key}={value}"] if value is not None else []) + list(extra)
    if key.lstrip("+").startswith("model."):
        cfg = compose_config("sft_trainer_engine", [f"model.path={model_dir}", "model.enable_gradient_checkpointing=false",
                                                    *overrides], validate=False)
        OmegaConf.resolve(cfg)
        return "sft", cfg, cfg.model
    cfg = compose_config("ppo_trainer", [
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "critic.model.enable_gradient_checkpointing=false",
        *overrides], validate=False)
    OmegaConf.resolve(cfg)
    if key.lstrip("+").startswith("critic."):
        return "critic", cfg.critic, cfg.critic.model
    return "actor", cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model


def engine(model_dir, key, value=None, *extra):
    role, role_cfg, model_cfg = section(model_dir, key, value, *extra)
    if role == "sft":
        from verl.workers.engine.fsdp.engine import FSDPEngine

        e = FSDPEngine(model_config=model_cfg, engine_config=role_cfg.engine, optimizer_config=role_cfg.optim,
                       checkpoint_config=role_cfg.checkpoint, role="sft")
    else:
        from verl.workers.engine_workers import build_engine

        e = build_engine(role_cfg, model_cfg, role, trainable=True)
    e.initialize()
    return e


def _hf(module):
    """The HF model under PEFT / value-head wrappers."""
    while hasattr(module, "get_base_model"):
        module = module.get_base_model()
    return getattr(module, "backbone", module)


# ------------------------------------------------------------------------------------------ where, what
@pytest.mark.parametrize("key", ["actor_rollout_ref.model.use_shm", "critic.model.use_shm", "model.use_shm"])
def test_use_shm_loads_from_a_copy_in_shared_memory(dense_dir, key, tmp_path, monkeypatch):
    import verl.utils.fs as fs
    from verl.utils.tokenizer import load_tokenizer_and_processor, local_model_path

    shm = tmp_path / "shm"
    shm.mkdir()
    real = fs.copy_to_shm
    monkeypatch.setattr(fs, "copy_to_shm", lambda path, shm_root=fs.SHM_ROOT: real(path, str(shm)))
    _, _, model_cfg = section(dense_dir, key, True)
    staged = local_model_path(model_cfg)
    assert staged.startswith(str(shm)) and (shm / staged.rsplit("/", 1)[1] / "config.json").exists()
    tok, _ = load_tokenizer_and_processor(model_cfg)
    assert tok.name_or_path == staged  # the tokenizer is read from the copy too
    _, _, plain = section(dense_dir, key, False)
    assert local_model_path(plain) == dense_dir


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.tokenizer_path", "model.tokenizer_path"])
def test_tokenizer_path_is_where_the_tokenizer_comes_from(dense_dir, key, tmp_path):
    from verl.utils.tokenizer import load_tokenizer_and_processor

    other = tmp_path / "tok"
    shutil.copytree(dense_dir, other)
    conf = json.loads((other / "tokenizer_config.json").read_text())
    conf["chat_template"] = "OTHER {{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(conf))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    _, _, model_cfg = section(dense_dir, key, str(other))
    tok, _ = load_tokenizer_and_processor(model_cfg)
    assert tok.chat_template.startswith("OTHER")
    tok, _ = load_tokenizer_and_processor(section(dense_dir, key.rsplit(".", 1)[0] + ".path", dense_dir)[2])
    assert not tok.chat_template.startswith("OTHER")


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.custom_chat_template", "model.custom_chat_template"])
def test_custom_chat_template_replaces_the_tokenizers(dense_dir, key):
    from verl.utils.tokenizer import load_tokenizer_and_processor

    tok, _ = load_tokenizer_and_processor(section(dense_dir, key, "'MINE {{ messages[0].content }}'")[2])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "MINE hi"


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.trust_remote_code", "critic.model.trust_remote_code",
                                 "model.trust_remote_code"])
def test_trust_remote_code_reaches_the_model_and_tokenizer_loaders(gloo, dense_dir, key, monkeypatch):
    import transformers

    import verl.models.registry as registry

    seen = []
    real_load, real_tok = registry.load_hf_model, transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(registry, "load_hf_model", lambda *a, **kw: (seen.append(("model", kw["trust_remote_code"])),
                                                                      real_load(*a, **kw))[1])
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: (seen.append(("tokenizer", kw.get("trust_remote_code"))), real_tok(*a, **kw))[1])
    from verl.utils.tokenizer import load_tokenizer_and_processor

    for value in (True, False):
        seen.clear()
        engine(dense_dir, key, value)
        load_tokenizer_and_processor(section(dense_dir, key, value)[2])
        assert set(seen) == {("model", value), ("tokenizer", value)}


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.override_config", "critic.model.override_config",
                                 "model.override_config"])
def test_override_config_changes_the_model_config(gloo, dense_dir, key):
    e = engine(dense_dir, "+" + key + ".attention_dropout", 0.25)
    assert _hf(e.module).config.attention_dropout == 0.25
    assert _hf(engine(dense_dir, key.rsplit(".", 1)[0] + ".path", dense_dir).module).config.attention_dropout == 0.0


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.model_type", "critic.model.model_type", "model.model_type"])
def test_model_type_must_match_the_checkpoint(gloo, dense_dir, key):
    engine(dense_dir, key, "qwen3_5_text")
    with pytest.raises(ValueError, match="model_type='llama' was declared"):
        engine(dense_dir, key, "llama")


# ------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("key", ["actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding",
                                 "model.use_remove_padding"])
def test_use_remove_padding_packs_sequences(gloo, dense_dir, key):
    assert engine(dense_dir, key, True).use_remove_padding is True
    assert engine(dense_dir, key, False).use_remove_padding is False


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.use_fused_kernels", "model.use_fused_kernels"])
def test_use_fused_kernels_and_backend(gloo, dense_dir, key, monkeypatch):
    import verl.models.transformers.monkey_patch as mp

    seen = []
    real = mp.apply_monkey_patch
    monkeypatch.setattr(mp, "apply_monkey_patch", lambda model, **kw: (seen.append(kw), real(model, **kw))[1])
    assert engine(dense_dir, key, False).use_fused_kernels is False
    e = engine(dense_dir, key, True)
    assert e.use_fused_kernels is True and seen[-1]["fused_kernels_backend"] == "torch"
    backend_key = key.rsplit(".", 1)[0] + ".fused_kernel_options.impl_backend"
    engine(dense_dir, key, True, f"{backend_key}=triton")
    assert seen[-1]["fused_kernels_backend"] == "triton"


def test_fused_kernel_backend_names():
    # (the keys test_use_fused_kernels_and_backend derives, as they are written in configs)
    assert {"actor_rollout_ref.model.fused_kernel_options.impl_backend",
            "model.fused_kernel_options.impl_backend"} == {
        k.rsplit(".", 1)[0] + ".fused_kernel_options.impl_backend"
        for k in ("actor_rollout_ref.model.use_fused_kernels", "model.use_fused_kernels")}


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.enable_gradient_checkpointing",
                                 "critic.model.enable_gradient_checkpointing", "model.enable_gradient_checkpointing"])
def test_enable_gradient_checkpointing(gloo, dense_dir, key):
    def on(module):
        module = _hf(module)
        return (module.model if hasattr(module, "value_head") else module).is_gradient_checkpointing

    assert on(engine(dense_dir, key, True).module) and not on(engine(dense_dir, key, False).module)


# ------------------------------------------------------------------------------------------ LoRA
def _lora_cfg(e):
    return e.module.peft_config["default"]


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "model"])
def test_lora_keys(gloo, dense_dir, prefix):
    keys = {"actor_rollout_ref.model": ["actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
                                        "actor_rollout_ref.model.target_modules", "actor_rollout_ref.model.exclude_modules",
                                        "actor_rollout_ref.model.lora_dropout"],
            "model": ["model.lora_rank", "model.lora_alpha", "model.target_modules", "model.exclude_modules",
                      "model.lora_dropout"]}[prefix]
    rank, alpha, targets, exclude, dropout = keys
    assert not engine(dense_dir, rank, 0).is_lora
    e = engine(dense_dir, rank, 4, f"{alpha}=8", f"{targets}=[q_proj,v_proj]", f"{dropout}=0.1")
    c = _lora_cfg(e)
    assert e.is_lora and (c.r, c.lora_alpha, set(c.target_modules), c.lora_dropout) == (4, 8, {"q_proj", "v_proj"}, 0.1)
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in e.module.named_parameters() if ".lora_A" in n}
    assert wrapped == {"q_proj", "v_proj"}
    e = engine(dense_dir, rank, 4, f"{targets}=all-linear", f"{exclude}=[o_proj]")
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in e.module.named_parameters() if ".lora_A" in n}
    assert "o_proj" not in wrapped and "q_proj" in wrapped


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.lora_adapter_path", "model.lora_adapter_path"])
def test_lora_adapter_path_continues_a_saved_adapter(gloo, dense_dir, key, tmp_path):
    import safetensors.torch

    from verl.utils.fsdp_utils import full_state_dict

    # an adapter on disk, as PEFT saves one: its config, and weights with lora_B set to 0.5 (a fresh one is 0)
    first = engine(dense_dir, key.rsplit(".", 1)[0] + ".lora_rank", 4)
    out = tmp_path / "adapter"
    first.module.peft_config["default"].save_pretrained(str(out))
    saved = {k.replace(".default", ""): (torch.full_like(v, 0.5) if "lora_B" in k else v)
             for k, v in full_state_dict(first.module).items() if "lora_" in k}
    safetensors.torch.save_file(saved, str(out / "adapter_model.safetensors"))
    e = engine(dense_dir, key, str(out))
    loaded = {k: v for k, v in full_state_dict(e.module).items() if "lora_B" in k}
    assert e.is_lora and loaded and all(torch.all(v == 0.5) for v in loaded.values())
    assert all(torch.all(v == 0) for k, v in full_state_dict(first.module).items() if "lora_B" in k)


def test_target_parameters_adds_adapters_to_fused_experts(gloo, moe_dir):
    for key in ("actor_rollout_ref.model.target_parameters", "model.target_parameters"):
        rank = key.rsplit(".", 1)[0] + ".lora_rank"
        e = engine(moe_dir, key, "all-experts", f"{rank}=4", key.rsplit(".", 1)[0] + ".lora_dropout=0")
        assert e.module.peft_config["default"].target_parameters
        assert any("experts" in n and "lora_" in n for n, _ in e.module.named_parameters()), key


def test_enable_router_aux_loss_trains_the_actors_router(gloo, moe_dir, monkeypatch):
    import verl.models.moe_router as moe_router

    trained = []
    real = moe_router.configure_moe_router
    monkeypatch.setattr(moe_router, "configure_moe_router",
                        lambda model, cfg, role: (trained.append(real(model, cfg, role)), trained[-1])[1])
    engine(moe_dir, "actor_rollout_ref.model.enable_router_aux_loss", True)
    engine(moe_dir, "actor_rollout_ref.model.enable_router_aux_loss", False)
    assert trained == [True, False]


def test_critic_model_path_is_the_critics_checkpoint(gloo, dense_dir, moe_dir):
    e = engine(dense_dir, "critic.model.path", moe_dir)
    assert "moe" in _hf(e.module).config.model_type
    assert "moe" not in _hf(engine(dense_dir, "critic.model.path", dense_dir).module).config.model_type
