"""The scoped RoPE patch: list -> set only inside the context, only where the method exists, restored."""

import pytest

from verl.utils.vllm.rope_patch import rope_ignore_keys_as_set


class _Base:
    def convert_rope_params_to_dict(self, **kwargs):
        keys = kwargs.get("ignore_keys_at_rope_validation")
        # transformers 5 does set arithmetic here; a list raises TypeError like the real failure.
        return {"a", "b"} - keys if keys is not None else set()


class _Config(_Base):
    pass


def test_list_becomes_set_inside_only():
    original = _Base.__dict__["convert_rope_params_to_dict"]
    with pytest.raises(TypeError):
        _Config().convert_rope_params_to_dict(ignore_keys_at_rope_validation=["a"])
    with rope_ignore_keys_as_set(_Config) as patched:
        assert patched
        assert _Config().convert_rope_params_to_dict(ignore_keys_at_rope_validation=["a"]) == {"b"}
        assert _Config().convert_rope_params_to_dict(ignore_keys_at_rope_validation={"b"}) == {"a"}
        with rope_ignore_keys_as_set(_Config) as nested:  # nested use does not double-wrap
            assert nested
    assert _Base.__dict__["convert_rope_params_to_dict"] is original
    with pytest.raises(TypeError):
        _Config().convert_rope_params_to_dict(ignore_keys_at_rope_validation=["a"])


def test_restored_on_error():
    original = _Base.__dict__["convert_rope_params_to_dict"]
    with pytest.raises(RuntimeError):
        with rope_ignore_keys_as_set(_Config):
            raise RuntimeError("engine creation failed")
    assert _Base.__dict__["convert_rope_params_to_dict"] is original


def test_noop_without_method():
    class Old:
        pass

    with rope_ignore_keys_as_set(Old) as patched:
        assert patched is False
    assert not hasattr(Old, "convert_rope_params_to_dict")


def test_real_transformers_config_roundtrip():
    from transformers import PretrainedConfig

    owner = next(k for k in PretrainedConfig.__mro__ if "convert_rope_params_to_dict" in vars(k))
    before = vars(owner)["convert_rope_params_to_dict"]
    with rope_ignore_keys_as_set() as patched:
        assert patched and vars(owner)["convert_rope_params_to_dict"] is not before
    assert vars(owner)["convert_rope_params_to_dict"] is before
