"""FSDP2 with CPU offload on one GPU: the patched VL forward (vision position embeddings included) runs and
matches the plain model. Run on a CUDA machine: pytest -m gpu tests/models/test_fsdp2_offload_gpu.py"""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from qwen35_test_utils import make_image_sample, patched_copy, token_log_probs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def single_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_vl_forward_under_fsdp2_cpu_offload(tiny_models, single_rank_group):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = tiny_models("vl")
    sample = make_image_sample(3, (1, 4, 8), 4, torch.Generator().manual_seed(0))
    ids = sample["input_ids"].cuda()
    rope_inputs = {k: sample[k] for k in ("input_ids", "mm_token_type_ids", "image_grid_thw")}
    pos = model.model.get_rope_index(**rope_inputs)[0].cuda()
    ref_model = copy.deepcopy(model).cuda()
    ref = token_log_probs(ref_model(**{k: v.cuda() for k, v in sample.items()}).logits, ids)

    sharded = patched_copy(model)
    for block in sharded.model.visual.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    for layer in sharded.model.language_model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(sharded, offload_policy=CPUOffloadPolicy())
    # grid_thw stays on the CPU (as processors return it); pixels are on the GPU.
    out = sharded(
        input_ids=ids,
        position_ids=pos,
        pixel_values=sample["pixel_values"].cuda(),
        image_grid_thw=sample["image_grid_thw"],
        use_cache=False,
    ).logits
    lp = token_log_probs(out, ids)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
    lp.sum().backward()
    grad = sharded.model.visual.pos_embed.weight.grad
    assert grad is not None and torch.isfinite(grad.full_tensor()).all()
