"""Upstream's newer LoRA section ``actor_rollout_ref.model.lora.*`` (and the SFT trainer's ``model.lora.*``): an
alias of the flat LoRA keys (rank, alpha, dropout, target_modules, exclude_modules, adapter_path), and
``lora.merge``, which sends the rollout engine base weights with the adapter merged in instead of adapter tensors
(the engine is then built without LoRA). On CPU with one gloo rank."""

from __future__ import annotations

import pytest
import torch

from test_keys_model import engine, section


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("keys_lora_section")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "model"])
def test_lora_section_is_the_flat_keys(gloo, dense_dir, prefix):
    e = engine(dense_dir, f"{prefix}.lora.rank", 4, f"{prefix}.lora.alpha=8", f"{prefix}.lora.dropout=0.1",
               f"{prefix}.lora.target_modules=[q_proj,v_proj,o_proj]", f"{prefix}.lora.exclude_modules=[o_proj]")
    c = e.module.peft_config["default"]
    assert e.is_lora and (c.r, c.lora_alpha, c.lora_dropout) == (4, 8, 0.1)
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in e.module.named_parameters() if ".lora_A" in n}
    assert wrapped == {"q_proj", "v_proj"}  # o_proj excluded
    _, _, model = section(dense_dir, f"{prefix}.lora.rank", 4)
    assert model.lora_rank == 4 and model.lora_alpha == 16  # the flat keys the readers see; unset stays default


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.lora.adapter_path", "model.lora.adapter_path"])
def test_lora_adapter_path_alias(gloo, dense_dir, tmp_path, key):
    from verl.workers.lora import save_lora_adapter

    first = engine(dense_dir, key.replace("adapter_path", "rank"), 4)
    save_lora_adapter(first.module, str(tmp_path))
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in first.module.named_parameters() if "lora_A" in n}
    _, _, model = section(dense_dir, key, str(tmp_path))
    assert model.lora_adapter_path == str(tmp_path)
    again = engine(dense_dir, key, str(tmp_path))  # continues the saved adapter (random lora_A, so not a fresh one)
    loaded = {n: p.detach() for n, p in again.module.named_parameters() if "lora_A" in n}
    assert again.is_lora and set(loaded) == set(saved)
    assert all(torch.equal(loaded[n].full_tensor() if hasattr(loaded[n], "full_tensor") else loaded[n],
                           saved[n].full_tensor() if hasattr(saved[n], "full_tensor") else saved[n]) for n in saved)


def test_section_and_flat_key_set_differently_is_refused(dense_dir):
    from verl.trainer.config import ConfigValidationError
    from verl.trainer.config.checks import compose_config

    base = ["actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={dense_dir}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2"]
    compose_config("ppo_trainer", [*base, "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora_rank=8"])
    with pytest.raises(ConfigValidationError, match=r"actor_rollout_ref.model.lora.rank"):
        compose_config("ppo_trainer", [*base, "actor_rollout_ref.model.lora.rank=8",
                                       "actor_rollout_ref.model.lora_rank=4"])


def test_lora_merge_sends_merged_weights_and_builds_vllm_without_lora(gloo, dense_dir):
    from verl.utils.fsdp_utils import full_state_dict
    from verl.workers.rollout.vllm_rollout.engine_args import build_llm_kwargs

    key = "actor_rollout_ref.model.lora.rank"
    adapter = engine(dense_dir, key, 4)
    weights, kwargs = adapter.get_rollout_weights()
    names = [n for n, _ in weights]
    assert "lora" in kwargs and names and all("lora_" in n for n in names)  # adapter tensors only

    merged_engine = engine(dense_dir, key, 4, "actor_rollout_ref.model.lora.merge=true")
    with torch.no_grad():  # a non-zero adapter, so merging changes the weights
        for n, p in merged_engine.module.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    weights, kwargs = merged_engine.get_rollout_weights()
    merged = {n: t.detach().clone() for n, t in weights}
    assert kwargs == {} and not any("lora_" in n for n in merged)
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in full_state_dict(merged_engine.module).items() if "lora_" not in k}
    q = next(n for n in merged if n.endswith("self_attn.q_proj.weight"))
    assert not torch.allclose(merged[q].float(), base[q].float())  # the adapter is folded in

    for merge, expect_lora in ((False, True), (True, False)):
        _, _, model = section(dense_dir, key, 4, f"actor_rollout_ref.model.lora.merge={merge}")
        from omegaconf import OmegaConf

        rollout = OmegaConf.create({"prompt_length": 8, "response_length": 8, "load_format": "dummy"})
        kw = build_llm_kwargs(rollout, model, on_gpu=False)
        assert kw.get("enable_lora", False) is expect_lora


def _a_weights(e):
    out = []
    for n, p in e.module.named_parameters():
        if ".lora_A." in n:
            out.append(p.full_tensor() if hasattr(p, "full_tensor") else p)
    return out


@pytest.mark.parametrize("prefix", ["actor_rollout_ref.model", "model"])
def test_lora_A_init_method_sets_the_fresh_adapters_distribution(gloo, dense_dir, prefix):
    key = f"{prefix}.lora.rank"
    xavier = _a_weights(engine(dense_dir, key, 4, f"{prefix}.lora.lora_A_init_method=xavier",
                               f"{prefix}.lora.lora_B_init_method=zero"))
    kaiming = _a_weights(engine(dense_dir, key, 4, f"{prefix}.lora.lora_A_init_method=kaiming"))
    assert xavier and len(xavier) == len(kaiming)
    for xa, ka in zip(xavier, kaiming):
        rank, fan_in = xa.shape
        kaiming_bound, xavier_bound = 1 / fan_in ** 0.5, (6 / (fan_in + rank)) ** 0.5
        assert ka.abs().max() <= kaiming_bound + 1e-6
        assert xa.abs().max() <= xavier_bound + 1e-6
    # over all adapters, xavier's wider range shows (its bound is > 2x kaiming's for rank 4 on these widths)
    assert max(float(x.detach().abs().max() * x.shape[1] ** 0.5) for x in xavier) > 1.5
    e = engine(dense_dir, key, 4, f"{prefix}.lora.lora_B_init_method=zero")
    assert all(float(p.detach().abs().max()) == 0 for n, p in e.module.named_parameters() if ".lora_B." in n)


def test_lora_init_method_values_are_validated(dense_dir):
    from verl.trainer.config import ConfigValidationError
    from verl.trainer.config.checks import compose_config

    base = ["actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={dense_dir}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.model.lora.rank=8"]
    compose_config("ppo_trainer", [*base, "actor_rollout_ref.model.lora.lora_A_init_method=kaiming"])
    for bad in ("actor_rollout_ref.model.lora.lora_A_init_method=normal",
                "actor_rollout_ref.model.lora.lora_B_init_method=xavier"):
        with pytest.raises(ConfigValidationError, match=bad.split("=")[0].replace(".", r"\.")):
            compose_config("ppo_trainer", [*base, bad])


def test_sft_lora_init_method_values_are_validated():
    from verl.trainer.config import ConfigValidationError
    from verl.trainer.sft_trainer import compose_sft_config, validate_sft_config

    cfg, strategy = compose_sft_config(["model.lora.rank=8", "model.lora.lora_A_init_method=xavier"])
    validate_sft_config(cfg, strategy)
    cfg, strategy = compose_sft_config(["model.lora.rank=8", "model.lora.lora_B_init_method=kaiming"])
    with pytest.raises(ConfigValidationError, match=r"model\.lora\.lora_B_init_method"):
        validate_sft_config(cfg, strategy)
