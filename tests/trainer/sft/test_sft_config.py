"""The SFT trainer's config: upstream keys, unknown keys answered with the nearest one, the embedded demo as
the default, the engine group switching the optimizer group, and the example scripts' overrides."""

import re
from pathlib import Path

import pytest

from verl.trainer.config.checks import ConfigKeyError, ConfigValidationError
from verl.trainer.sft_trainer import compose_sft_config, load_config, main, validate_sft_config

REPO = Path(__file__).resolve().parents[3]

UPSTREAM_KEYS = [
    "data.messages_key", "data.tools_key", "data.enable_thinking_key", "data.enable_thinking_default",
    "data.pad_mode", "data.max_length", "data.truncation", "data.micro_batch_size_per_gpu", "data.use_dynamic_bsz",
    "data.max_token_len_per_gpu", "data.train_batch_size", "data.ignore_input_ids_mismatch",
    "data.apply_chat_template_kwargs", "data.train_max_samples", "data.val_max_samples", "data.custom_cls.path",
    "data.num_workers", "model.path", "model.lora_rank", "model.lora_alpha", "model.target_modules",
    "model.use_remove_padding", "optim.lr", "optim.lr_warmup_steps_ratio", "optim.clip_grad",
    "checkpoint.save_contents", "checkpoint.load_contents", "trainer.default_local_dir", "trainer.project_name",
    "trainer.experiment_name", "trainer.total_epochs", "trainer.total_training_steps", "trainer.logger",
    "trainer.seed", "trainer.save_freq", "trainer.test_freq", "trainer.max_ckpt_to_keep", "trainer.resume_mode",
    "trainer.resume_from_path", "trainer.device", "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.balance_batch",
]


def test_upstream_keys_exist_and_demo_is_the_default():
    from omegaconf import OmegaConf

    cfg, strategy = compose_sft_config([])
    for key in UPSTREAM_KEYS:
        assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key
    assert strategy == "fsdp"
    assert cfg.data.train_files.endswith("train.parquet") and "calculator_calls" in cfg.data.train_files
    validate_sft_config(cfg, strategy)
    # Overrides apply on top of the demo ...
    cfg, _ = compose_sft_config(["trainer.total_training_steps=3", "optim.lr=1e-4"])
    assert "calculator_calls" in cfg.data.train_files and cfg.optim.lr == 1e-4
    # ... until the user names their own model or data: then upstream's defaults.
    cfg, _ = compose_sft_config(["model.path=/m", "data.train_files=/d.parquet"])
    assert cfg.trainer.project_name == "gsm8k-sft" and cfg.data.train_batch_size == 256


def test_unknown_key_names_the_nearest_one(capsys):
    with pytest.raises(ConfigKeyError, match=r"`data.mesages_key` is not a config key. Did you mean `data.messages_key`"):
        load_config(["data.mesages_key=msgs"])
    assert main(["trainer.totl_epochs=3"]) == 2
    assert "trainer.total_epochs" in capsys.readouterr().err


def test_engine_group_selects_megatron_optimizer():
    cfg, strategy = compose_sft_config(["model.path=/m", "data.train_files=/d", "engine=megatron"])
    assert strategy == "megatron" and "tensor_model_parallel_size" in cfg.engine
    assert cfg.optim.optimizer == "adam" and "lr_decay_style" in cfg.optim


def test_lora_on_megatron_is_refused_with_sft_keys():
    """The Megatron engine has no LoRA; without this check the run failed at engine start naming the RL key
    (actor_rollout_ref.model.lora_rank)."""
    for override in ("model.lora_rank=8", "model.lora_adapter_path=/adapters"):
        cfg, strategy = compose_sft_config(["engine=megatron", override])
        with pytest.raises(ConfigValidationError) as err:
            validate_sft_config(cfg, strategy)
        text = str(err.value)
        assert f"`{override}` with `engine=megatron`" in text and "`engine=fsdp`" in text, text
        assert "actor_rollout_ref" not in text
    cfg, strategy = compose_sft_config(["model.lora_rank=8"])  # LoRA on FSDP stays valid
    validate_sft_config(cfg, strategy)


def test_validation_names_every_bad_key():
    cfg, strategy = compose_sft_config(["data.pad_mode=packed", "data.truncation=middle", "trainer.save_freq=often",
                                        "trainer.resume_mode=maybe", "data.micro_batch_size_per_gpu=0"])
    with pytest.raises(ConfigValidationError) as err:
        validate_sft_config(cfg, strategy)
    text = str(err.value)
    for key in ("data.pad_mode", "data.truncation", "trainer.save_freq", "trainer.resume_mode",
                "data.micro_batch_size_per_gpu"):
        assert key in text
    cfg, strategy = compose_sft_config(["model.use_remove_padding=false"])
    with pytest.raises(ConfigValidationError, match="no_padding.*model.use_remove_padding=true"):
        validate_sft_config(cfg, strategy)
    with pytest.raises(ConfigValidationError, match="not a registered training engine"):
        validate_sft_config(cfg, "fdsp")


def _script_overrides(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "verl.trainer.sft_trainer" in ln)
    args = line.split("verl.trainer.sft_trainer", 1)[1].replace('"$@"', "").split()
    out = []
    for a in args:
        a = re.sub(r'"?\$\{?(\w+)\}?"?', "1", a).replace('"', "")
        out.append(a.replace("'", ""))
    return out


@pytest.mark.parametrize("script", sorted((REPO / "examples" / "sft").rglob("*.sh")), ids=lambda p: p.name)
def test_example_scripts_compose(script):
    overrides = _script_overrides(script)
    cfg, strategy = compose_sft_config(overrides)
    assert str(cfg.model.path) == "1"
    assert strategy == ("megatron" if "megatron" in script.name else "fsdp")


def test_custom_dataset_class(tmp_path):
    from omegaconf import OmegaConf

    from verl.trainer.sft_trainer import create_sft_dataset

    (tmp_path / "my_ds.py").write_text(
        "from torch.utils.data import Dataset\n"
        "class Rows(Dataset):\n"
        "    def __init__(self, files, tokenizer, config, processor=None, max_samples=-1):\n"
        "        self.files, self.max_samples = files, max_samples\n"
        "    def __len__(self):\n"
        "        return 0\n")
    cfg = OmegaConf.create({"custom_cls": {"path": str(tmp_path / "my_ds.py"), "name": "Rows"}})
    ds = create_sft_dataset(["a.parquet"], cfg, tokenizer=None, processor=None, max_samples=3)
    assert type(ds).__name__ == "Rows" and ds.max_samples == 3
    cfg = OmegaConf.create({"custom_cls": {"path": str(tmp_path / "my_ds.py"), "name": "Missing"}})
    with pytest.raises(AttributeError, match="Missing"):
        create_sft_dataset(["a.parquet"], cfg, tokenizer=None, processor=None)
