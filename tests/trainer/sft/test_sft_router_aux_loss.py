"""``model.enable_router_aux_loss`` in the SFT trainer: on a MoE Qwen3.5, SFT trains the router with the HF
load-balancing loss (``router_aux_loss_coef * aux_loss``, added through the logits' backward) only when the key
is on; the reported loss stays the language-model loss. The Megatron engine refuses the key by name. The key
names are spelled out so key_status.txt can point here."""

import pytest

from tests.trainer.sft.test_sft_trainer import run_in_process

SMALL = ["--config-name=sft_demo", "data.train_max_samples=16", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8",
         "data.use_dynamic_bsz=false", "trainer.resume_mode=disable", "trainer.total_training_steps=2",
         "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.device=cpu", "+model.override_config.router_aux_loss_coef=1.0"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("sft_moe")
    build_tiny_qwen3_5(str(path), kind="moe", seed=0)
    return str(path)


def test_enable_router_aux_loss_trains_the_sft_router(tmp_path, moe_dir, monkeypatch):
    import verl.models.moe_router as moe_router

    trained = []
    real = moe_router.configure_moe_router
    monkeypatch.setattr(moe_router, "configure_moe_router",
                        lambda model, cfg, role: (trained.append(real(model, cfg, role)), trained[-1])[1])
    runs = {on: run_in_process(tmp_path / str(on), [*SMALL, f"model.path={moe_dir}",
                                                    f"model.enable_router_aux_loss={str(on).lower()}"])["history"]
            for on in (True, False)}
    assert trained == [True, False]
    # Same weights and batch at step 1: the same LM loss, but the aux loss adds gradient (to the routers)
    assert runs[True][0]["train/loss"] == pytest.approx(runs[False][0]["train/loss"], rel=1e-6)
    assert runs[True][0]["train/grad_norm"] != pytest.approx(runs[False][0]["train/grad_norm"], rel=1e-3)


def test_enable_router_aux_loss_is_refused_on_megatron():
    from verl.trainer.config.checks import ConfigValidationError
    from verl.trainer.sft_trainer import compose_sft_config, validate_sft_config

    cfg, strategy = compose_sft_config(["model.path=/m", "data.train_files=x", "engine=megatron",
                                        "model.enable_router_aux_loss=true"])
    with pytest.raises(ConfigValidationError, match="`model.enable_router_aux_loss=true` with `engine=megatron`"):
        validate_sft_config(cfg, strategy)
