"""The Megatron engine's Hugging Face copy for the hf rollout can hand its parameter memory back between
generations (``rollout.free_cache_engine``): :func:`release_hf_module` frees every parameter's storage in place,
:func:`restore_hf_module` gives it back (uninitialised) for the sync to fill. Here on a real tiny Qwen3.5 on the
CPU, with the sync stood in for by a state-dict copy; the engine path itself is in test_megatron_qwen35_gpu.py."""

from __future__ import annotations

import pytest
import torch

from verl.workers.engine.megatron.weights import release_hf_module, restore_hf_module


@pytest.mark.parametrize("tied", [False, True])
def test_release_frees_every_parameter_and_restore_takes_a_refill(tmp_path, tied):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    model = build_tiny_qwen3_5(None, kind="dense", with_tokenizer=False, tie_word_embeddings=tied).eval()
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        before = model(ids).logits
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())

    assert release_hf_module(model) is True
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert release_hf_module(model) is False  # already released: nothing more to free
    assert {n for n, b in model.named_buffers()} and all(b.untyped_storage().nbytes() for b in model.buffers())

    restore_hf_module(model)
    restored = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())
    assert restored == nbytes
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():  # the engine's sync writes every parameter; a state-dict copy stands in for it here
        for name, p in model.named_parameters():
            p.copy_(saved[name])
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    restore_hf_module(model)  # restoring a module that is not released changes nothing
    assert all(p.untyped_storage().nbytes() for p in model.parameters())
