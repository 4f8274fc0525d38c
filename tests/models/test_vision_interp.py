"""Vision position-embedding interpolation built on the input's device."""

import torch
import torch.nn.functional as F
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from verl.models.transformers.qwen3_5 import fast_pos_embed_interpolate, vision_interp_indices_weights


def _reference(visual, grid_thw):
    """F.interpolate of the square table to each (h, w), reordered into spatial-merge blocks."""
    side, merge = visual.num_grid_per_side, visual.spatial_merge_size
    table = visual.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]
    outs = []
    for t, h, w in grid_thw.tolist():
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        grid = grid.reshape(h // merge, merge, w // merge, merge, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
        outs.append(grid.repeat(t, 1))
    return torch.cat(outs)


def test_matches_bilinear_resample(tiny_models):
    visual = tiny_models("vl").model.visual
    grid = torch.tensor([[1, 4, 6], [2, 8, 4], [1, 2, 2]])
    got = fast_pos_embed_interpolate(visual, grid)
    torch.testing.assert_close(got, _reference(visual, grid), atol=1e-6, rtol=1e-5)


def test_matches_transformers_indices(tiny_models):
    visual = tiny_models("vl").model.visual
    grid = torch.tensor([[1, 6, 4], [1, 2, 8]])
    idx, wts = vision_interp_indices_weights(grid, visual.num_grid_per_side, visual.spatial_merge_size, grid.device)
    ref_idx, ref_wts = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=visual.num_grid_per_side, mode="bilinear", align_corners=True,
        spatial_merge_size=visual.spatial_merge_size,
    )
    emb = visual.pos_embed
    torch.testing.assert_close(
        (emb(idx) * wts[..., None]).sum(1), (emb(ref_idx) * ref_wts[..., None]).sum(1), atol=1e-6, rtol=1e-5
    )


def test_reads_table_through_module_call(tiny_models):
    """The table must be fetched by calling the module (FSDP2 unshards in its pre-forward hook)."""
    visual = tiny_models("vl").model.visual
    calls = []
    handle = visual.pos_embed.register_forward_pre_hook(lambda mod, args: calls.append(args[0].device))
    try:
        fast_pos_embed_interpolate(visual, torch.tensor([[1, 4, 4]]), device=torch.device("cpu"))
    finally:
        handle.remove()
    assert calls == [torch.device("cpu")]
