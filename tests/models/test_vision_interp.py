"""Vision position-embedding interpolation built on the input's device (seed 001's FSDP2 CPU-offload fix), and the
patched vision forward that runs it."""

import pytest
import torch
import torch.nn.functional as F
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from qwen35_test_utils import patched_copy
from verl.models.qwen3_5.hf_forward import fast_pos_embed_interpolate, vision_interp_indices_weights


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


def _vision_tower(tiny_models, kind):
    """The (patched copy of the) vision tower of a tiny VL model, and the stock one it was copied from."""
    model = tiny_models(kind)
    return patched_copy(model).model.visual, model.model.visual


@pytest.mark.parametrize("kind", ["vl", "vl_moe"])
def test_patched_vision_forward_matches_stock(tiny_models, kind):
    """qwen3_5.vision_forward (what the patched VL model runs, on CPU as well) equals the stock tower, outputs
    and the position table's gradient alike."""
    patched, stock = _vision_tower(tiny_models, kind)
    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, 4, 8], [2, 4, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 96, generator=gen)
    outs = []
    for tower in (stock, patched):
        tower.zero_grad()
        out = tower(pixels, grid_thw=grid)
        out.pooler_output.square().sum().backward()
        outs.append((out.last_hidden_state, out.pooler_output, tower.pos_embed.weight.grad.clone()))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert outs[0][2].abs().sum() > 0


def test_vision_forward_embeds_positions_with_fast_pos_embed_interpolate(tiny_models, monkeypatch):
    """The seed's device-safe interpolation is the one the production VL forward runs (not a test-only twin)."""
    from verl.models.qwen3_5 import hf_forward as qwen3_5

    patched, _ = _vision_tower(tiny_models, "vl")
    calls = []
    real = qwen3_5.fast_pos_embed_interpolate

    def spy(visual, grid_thw, device=None):
        calls.append((visual, grid_thw.tolist(), device))
        return real(visual, grid_thw, device)

    monkeypatch.setattr(qwen3_5, "fast_pos_embed_interpolate", spy)
    grid = torch.tensor([[1, 4, 4]])
    patched(torch.zeros(16, 96), grid_thw=grid)
    assert calls == [(patched, [[1, 4, 4]], torch.device("cpu"))]


def test_other_interpolation_modes_are_refused(tiny_models):
    visual = tiny_models("vl").model.visual
    try:
        visual.interpolation_mode = "bicubic"
        with pytest.raises(NotImplementedError, match="bilinear"):
            fast_pos_embed_interpolate(visual, torch.tensor([[1, 4, 4]]))
    finally:
        visual.interpolation_mode = "bilinear"
