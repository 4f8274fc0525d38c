"""Logits from any model output: HF ModelOutput, a tuple ``(logits, ...)``, a bare tensor."""

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from verl.utils.model_output import get_logits


def test_get_logits_shapes_of_output():
    logits = torch.randn(1, 3, 5)
    assert get_logits(CausalLMOutputWithPast(logits=logits)) is logits
    assert get_logits((logits, None)) is logits
    assert get_logits(logits) is logits
    with pytest.raises(TypeError, match="cannot find logits"):
        get_logits({"scores": logits})


def test_actor_accepts_tuple_outputs():
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.engine import FSDPEngine

    engine = FSDPEngine.__new__(FSDPEngine)  # only the output-reading helper is exercised
    engine.use_fused_kernels = False
    engine._entropy_fn = verl_F.entropy_from_logits
    logits = torch.randn(1, 4, 7)
    labels = torch.randint(0, 7, (1, 4))
    from_tuple = engine._token_stats((logits,), labels, 1.0, ("entropy",))
    from_obj = engine._token_stats(CausalLMOutputWithPast(logits=logits), labels, 1.0, ("entropy",))
    torch.testing.assert_close(from_tuple["log_probs"], from_obj["log_probs"])
    torch.testing.assert_close(from_tuple["entropy"], from_obj["entropy"])
