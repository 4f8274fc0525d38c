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
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    actor = DataParallelPPOActor.__new__(DataParallelPPOActor)  # only the output-reading helper is exercised
    actor.use_fused_kernels = False
    logits = torch.randn(1, 4, 7)
    labels = torch.randint(0, 7, (1, 4))
    lp_tuple, ent_tuple = actor._token_stats((logits,), labels, 1.0, True)
    lp_obj, ent_obj = actor._token_stats(CausalLMOutputWithPast(logits=logits), labels, 1.0, True)
    torch.testing.assert_close(lp_tuple, lp_obj)
    torch.testing.assert_close(ent_tuple, ent_obj)
