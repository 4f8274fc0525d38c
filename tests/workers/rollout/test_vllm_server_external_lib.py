"""Server mode imports ``model.external_lib`` in the spawned rollout-server process before it builds the
engine, so a weight loader registered there (verl.models.dtensor_weight_loader) is what the server's engine
finds; without it the engine would silently fall back to vLLM's own loader. No vLLM needed: the engine is
:class:`LoaderProbe`, a STAND-IN for vLLMRollout that reports what the registry held when it was built."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.workers.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from verl.workers.rollout.vllm_rollout.server import vLLMServerClient

ARCH = "VerlServerExtLibTestForCausalLM"
LIB = "verl_server_ext_lib_test"


class LoaderProbe:
    """STAND-IN engine: looks its architecture's loader up at construction, as vLLMRollout does."""

    def __init__(self, config, model_config, tokenizer=None, module=None, processor=None, standalone=False):
        from verl.models.dtensor_weight_loader import get_weight_loader

        self.found = get_weight_loader([ARCH]) is not None

    def generate(self, requests, params):
        return [[GenerationOutput([int(self.found)], None, "length")] for _ in requests]


def _client(model_config: dict) -> vLLMServerClient:
    cfg = OmegaConf.create({"checkpoint_engine": {"update_weights_bucket_megabytes": 1}})
    return vLLMServerClient(cfg, model_config, backend="gloo", engine_cls=f"{__name__}.LoaderProbe",
                            start_timeout=300)


@pytest.fixture
def lib_on_path(tmp_path, monkeypatch):
    # Spawned children start with the parent's sys.path, so they can import the module written here.
    (tmp_path / f"{LIB}.py").write_text(
        "from verl.models.dtensor_weight_loader import register_weight_loader\n"
        f"register_weight_loader({ARCH!r}, lambda actor_weights, vllm_model: vllm_model)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def _found(client) -> int:
    return client.generate([GenerationRequest([1])], SamplingParams())[0][0].token_ids[0]


def test_server_imports_external_lib_before_building_the_engine(lib_on_path):
    with_lib = _client({"path": "unused", "external_lib": LIB})
    try:
        assert _found(with_lib) == 1
    finally:
        with_lib.shutdown()


def test_server_without_external_lib_has_no_custom_loader(lib_on_path):
    # The control: the loader is in the server only because external_lib named its module.
    plain = _client({"path": "unused"})
    try:
        assert _found(plain) == 0
    finally:
        plain.shutdown()


def test_server_reports_an_unimportable_external_lib(lib_on_path):
    with pytest.raises(RuntimeError, match=r"(?s)failed to start.*model\.external_lib='no_such_module_xyz'"):
        _client({"path": "unused", "external_lib": "no_such_module_xyz"})
