"""The Megatron engine's model-source seams on CPU (no megatron-core needed): ``model.path`` as a Hugging Face
Hub id resolves through the HF cache, ``model.external_lib`` is imported before the checkpoint's config is
read, and the HF export's tokenizer copy follows the resolved source instead of silently skipping a hub id.

The engine is made with ``MegatronEngine.__new__`` plus the attributes these code paths read, because its
``__init__`` requires megatron-core (absent on CPU hosts); the methods under test are the real ones."""

from __future__ import annotations

import json
import sys

import pytest
from omegaconf import OmegaConf

from verl.workers.engine.megatron.engine import MegatronEngine
from verl.workers.engine.megatron.settings import read_settings

HUB_ID = "someorg/tiny-megatron-test"


def _fake_hf_cache(root, repo_id, files: dict):
    """huggingface_hub's cache layout: hub/models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo_dir = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    for name, text in files.items():
        (snap / name).write_text(text)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(snap.name)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return tmp_path


def _engine(model_config: dict, role: str = "actor") -> MegatronEngine:
    e = MegatronEngine.__new__(MegatronEngine)
    e.model_config = OmegaConf.create(model_config)
    e.role = role
    e.settings = read_settings({})
    e._prefix = "critic.megatron" if role == "critic" else "actor_rollout_ref.actor.megatron"
    e._model_dir = None
    e.processing_class = None
    e.router_replay_mode = "disabled"
    e.share_module_with, e.lora = None, None
    return e


TOKENIZER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "generation_config.json": "{}",
                   "config.json": "{}", "model.safetensors": "not copied"}


def test_megatron_hf_export_copies_the_tokenizer_of_a_hub_id(offline_cache, tmp_path):
    from verl.workers.engine.megatron.checkpoint import _copy_tokenizer_files

    snap = _fake_hf_cache(offline_cache, HUB_ID, TOKENIZER_FILES)
    engine = _engine({"path": HUB_ID})
    assert engine.model_path == str(snap)
    out = tmp_path / "huggingface"
    out.mkdir()
    _copy_tokenizer_files(engine, str(out))
    # tokenizer and generation files only; config and weights are written by the export itself
    assert sorted(p.name for p in out.iterdir()) == ["generation_config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]


def test_megatron_tokenizer_copy_prefers_tokenizer_path(offline_cache, tmp_path):
    from verl.workers.engine.megatron.checkpoint import _copy_tokenizer_files

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"from": "model"}')
    tok = _fake_hf_cache(offline_cache, "someorg/tok-only", {"tokenizer.json": '{"from": "tokenizer_path"}'})
    out = tmp_path / "out"
    out.mkdir()
    _copy_tokenizer_files(_engine({"path": str(model), "tokenizer_path": "someorg/tok-only"}), str(out))
    assert json.loads((out / "tokenizer.json").read_text()) == {"from": "tokenizer_path"}
    assert tok.is_dir()


def test_megatron_unresolvable_source_is_an_error_naming_the_key(offline_cache, tmp_path):
    from verl.utils.user_errors import UserFacingError
    from verl.workers.engine.megatron.checkpoint import _copy_tokenizer_files

    with pytest.raises(UserFacingError, match=r"critic\.model\.path='someorg/not-cached'.*HF_HUB_OFFLINE"):
        _copy_tokenizer_files(_engine({"path": "someorg/not-cached"}, role="critic"), str(tmp_path))


class _Stop(Exception):
    """Raised where the CPU test stops initialize(): the config has been read, megatron-core would be next."""


def test_megatron_initialize_imports_external_lib_before_reading_a_hub_config(offline_cache, tmp_path, monkeypatch):
    # The checkpoint's model_type exists only once the external lib has registered it with AutoConfig.
    model_type = "verl_megatron_ext_test"
    lib = tmp_path / "libs" / "verl_megatron_ext_lib.py"
    lib.parent.mkdir()
    lib.write_text(
        "from transformers import AutoConfig, PretrainedConfig\n"
        f"class ExtConfig(PretrainedConfig):\n    model_type = {model_type!r}\n"
        f"AutoConfig.register({model_type!r}, ExtConfig)\n"
    )
    monkeypatch.syspath_prepend(str(lib.parent))
    monkeypatch.delitem(sys.modules, lib.stem, raising=False)
    _fake_hf_cache(offline_cache, HUB_ID, {"config.json": json.dumps({"model_type": model_type})})

    from verl.models.mcore import registry
    from verl.workers.engine.megatron import build

    monkeypatch.setattr(build, "init_parallel_state", lambda s: None)  # no process group / megatron-core here

    def stop(hf_config, *a, **kw):
        raise _Stop(hf_config.model_type)

    monkeypatch.setattr(registry, "hf_to_mcore_config", stop)
    engine = _engine({"path": HUB_ID, "external_lib": lib.stem})
    # _Stop once the config is converted; ImportError where megatron-core is absent (the TransformerConfig
    # import comes first). Either way the custom config was read from the hub id's cached snapshot.
    with pytest.raises((_Stop, ImportError)):
        engine.initialize()
    assert lib.stem in sys.modules
    assert engine.hf_config.model_type == model_type
