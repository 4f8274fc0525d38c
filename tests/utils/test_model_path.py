"""model.path: local dirs pass, hub ids go through Hugging Face's cache/downloader, offline misses say what to do."""

import pytest

from verl.utils.model_path import is_hub_id, resolve_model_path
from verl.utils.user_errors import UserFacingError


def _fake_hf_cache(home, repo_id, files=("config.json",)):
    """The on-disk layout huggingface_hub's cache uses: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo_dir = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for name in files:
        (snap / name).write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(snap.name)
    return snap


def test_local_directory_is_returned_as_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_hub_id_shapes():
    assert is_hub_id("Qwen/Qwen3.5-9B") and is_hub_id("gpt2")
    assert not is_hub_id("/abs/dir") and not is_hub_id("./rel") and not is_hub_id("a/b/c") and not is_hub_id("../x")


def test_hub_id_found_in_the_hf_cache_offline(tmp_path, monkeypatch):
    snap = _fake_hf_cache(tmp_path, "Qwen/Qwen3.5-9B")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("Qwen/Qwen3.5-9B") == str(snap)


def test_hub_id_missing_offline_is_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserFacingError) as info:
        resolve_model_path("Qwen/Qwen3.5-9B")
    text = str(info.value)
    assert text.startswith("Model error: actor_rollout_ref.model.path='Qwen/Qwen3.5-9B'")
    assert "HF_HUB_OFFLINE" in text and "huggingface-cli download Qwen/Qwen3.5-9B" in text and "\n" not in text


def test_not_a_dir_nor_hub_id(tmp_path):
    with pytest.raises(UserFacingError, match="not a directory and not a Hugging Face Hub id"):
        resolve_model_path(str(tmp_path / "missing" / "deeper" / "x"))


def test_model_config_dir_reads_dicts_and_dictconfigs(tmp_path, monkeypatch):
    """Engines and the rollout resolve ``model.path`` through this; the section's use_shm decides staging."""
    from omegaconf import OmegaConf

    from verl.utils import model_path as mp

    staged = []
    monkeypatch.setattr("verl.utils.fs.copy_to_shm", lambda p: staged.append(p) or "/dev/shm/x")
    assert mp.model_config_dir({"path": str(tmp_path)}) == str(tmp_path)
    assert mp.model_config_dir(OmegaConf.create({"path": str(tmp_path), "use_shm": True})) == "/dev/shm/x"
    assert staged == [str(tmp_path)]
    # use_shm=False wins over the section (the tokenizer is never staged)
    assert mp.model_config_dir({"path": str(tmp_path), "use_shm": True}, use_shm=False) == str(tmp_path)
    assert mp.model_config_dir({"tokenizer_path": str(tmp_path)}, key="tokenizer_path") == str(tmp_path)


def test_model_config_dir_unset_or_bad_names_the_key(tmp_path):
    from verl.utils.model_path import model_config_dir

    with pytest.raises(UserFacingError, match=r"^Model error: critic\.model\.path is not set"):
        model_config_dir({"path": None}, what="critic.model.path")
    with pytest.raises(UserFacingError, match=r"actor_rollout_ref\.model\.tokenizer_path='.*' is not a directory"):
        model_config_dir({"tokenizer_path": str(tmp_path / "a" / "b" / "c")}, key="tokenizer_path")


def test_model_config_dir_resolves_hub_ids(tmp_path, monkeypatch):
    snap = _fake_hf_cache(tmp_path, "Qwen/Qwen3.5-9B")
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    from verl.utils.model_path import model_config_dir

    assert model_config_dir({"path": "Qwen/Qwen3.5-9B"}) == str(snap)
