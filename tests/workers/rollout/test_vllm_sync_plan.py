"""Which name rules and which vLLM-Ascend path a full sync takes (the decisions vLLMRollout makes; no vLLM)."""

import pytest

from verl.workers.rollout.vllm_rollout.vllm_rollout import sync_layout, uses_runtime_expert_writer


def _qwen35(kind):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    return build_tiny_qwen3_5(None, kind=kind, with_tokenizer=False).config


@pytest.mark.parametrize("ascend", [False, True])
def test_qwen3_5_moe_layout_and_ascend_paths(ascend):
    layout = sync_layout(_qwen35("moe"), ["model.layers.0.mlp.experts.w13_weight"], ascend=ascend)
    assert layout.moe and layout.expert_format == ("per_expert" if ascend else "fused")
    # colocated on vLLM-Ascend: runtime-layout writes; a server reloads through the checkpoint loader
    assert uses_runtime_expert_writer(layout, ascend=ascend, standalone=False) is ascend
    assert uses_runtime_expert_writer(layout, ascend=ascend, standalone=True) is False


def test_dense_never_uses_the_expert_writer():
    layout = sync_layout(_qwen35("dense"), [], ascend=True)
    assert not layout.moe and not uses_runtime_expert_writer(layout, ascend=True, standalone=False)


def test_other_architectures_go_to_vllms_loader_untouched():
    from transformers import Qwen2Config

    assert sync_layout(Qwen2Config(architectures=["Qwen2ForCausalLM"]), [], ascend=False) is None
    assert uses_runtime_expert_writer(None, ascend=True, standalone=False) is False


class _RecordingLayout:
    """A layout class a user's model spec could name: records how the sync built it."""

    def __init__(self, config, kw):
        self.config, self.kw, self.engine_names = config, kw, None

    @classmethod
    def from_hf_config(cls, config, **kw):
        return cls(config, kw)

    def matching_engine(self, names):
        self.engine_names = list(names)
        return self


def test_layout_comes_from_the_model_spec(monkeypatch):
    """The spec's ``weight_sync_layout`` is the one place that picks the layout: a registered architecture
    naming its own class gets that class, and a Qwen3.5 spec stripped of the field gets vLLM's loader
    untouched (no family check behind the spec's back)."""
    import dataclasses

    from transformers import Qwen2Config

    from verl.models.registry import SUPPORTED_ARCHITECTURES, get_model_spec

    cfg = Qwen2Config(architectures=["MyLayoutLM"])
    spec = dataclasses.replace(get_model_spec(cfg), architecture="MyLayoutLM",
                               weight_sync_layout=f"{__name__}._RecordingLayout")
    monkeypatch.setitem(SUPPORTED_ARCHITECTURES, "MyLayoutLM", spec)
    layout = sync_layout(cfg, ["a.weight"], ascend=True)
    assert isinstance(layout, _RecordingLayout) and layout.config is cfg
    assert layout.kw == {"language_model_only": True, "expert_format": "per_expert"}
    assert layout.engine_names == ["a.weight"]

    qwen = _qwen35("dense")
    arch = qwen.architectures[0]
    monkeypatch.setitem(SUPPORTED_ARCHITECTURES, arch,
                        dataclasses.replace(SUPPORTED_ARCHITECTURES[arch], weight_sync_layout=None))
    assert sync_layout(qwen, [], ascend=False) is None


def test_every_wake_checks_nz_on_ascend(monkeypatch):
    """vLLMRollout.sleep/wake_up with a recording STAND-IN for ``vllm.LLM`` (sleep mode needs CUDA/NPU)."""
    from types import SimpleNamespace

    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    calls = []
    r = vLLMRollout.__new__(vLLMRollout)  # the methods under test need only these attributes
    r.free_cache_engine, r._sleep_supported, r.ascend, r.is_sleeping, r.lora_rank = True, True, True, False, 0
    r.llm = SimpleNamespace(sleep=lambda level: calls.append(("sleep", level)),
                            wake_up=lambda tags: calls.append(("wake", tuple(tags))))
    r.sleep()
    assert r.is_sleeping and r.weights_lost_in_sleep and calls == [("sleep", 2)]
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ='1'"):
        r.wake_up(("weights",))
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    r.wake_up(("weights",))
    assert r.is_sleeping  # the KV cache is still released
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ"):  # checked again at the next wake
        r.wake_up(("kv_cache",))
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    r.wake_up(("kv_cache",))
    assert not r.is_sleeping and calls[1:] == [("wake", ("weights",)), ("wake", ("kv_cache",))]
    r.lora_rank = 8
    r.sleep()
    assert calls[-1] == ("sleep", 1) and not r.weights_lost_in_sleep  # LoRA keeps the base weights
    r.free_cache_engine = False
    r.is_sleeping = False
    r.sleep()
    assert calls[-1] == ("sleep", 1) and not r.is_sleeping  # free_cache_engine=False: never sleeps
