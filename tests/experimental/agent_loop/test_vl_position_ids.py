"""mRoPE position ids for a tiny Qwen3.5-VL image conversation must match what the model computes itself."""

import pytest
import torch

from verl.experimental.agent_loop import compute_position_ids, rope_indexer_from_config
from verl.models.tiny import build_tiny_tokenizer
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5


@pytest.fixture(scope="module")
def vl():
    return build_tiny_qwen3_5(kind="vl"), build_tiny_tokenizer()


def _image_row(tok, n_pad_left=3):
    grid = torch.tensor([[1, 8, 4]])  # t, h, w patches -> 8*4 / (2*2) = 8 image tokens
    n_img = int(grid.prod()) // 4
    ids = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    ids += [tok.convert_tokens_to_ids("<|image_pad|>")] * n_img
    ids += tok.encode("<|vision_end|>what?<|im_end|>\n<|im_start|>assistant\nA cat.", add_special_tokens=False)
    input_ids = torch.tensor([[tok.pad_token_id] * n_pad_left + ids])
    mask = torch.tensor([[0] * n_pad_left + [1] * len(ids)])
    return input_ids, mask, grid


def _model_positions(model, input_ids, mask, grid):
    """Capture the position ids the model's forward hands to its language model."""
    seen = {}

    def hook(_module, _args, kwargs):
        seen["pos"] = kwargs["position_ids"]

    h = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    pixel_values = torch.randn(int(grid.prod()), 3 * 2 * 4 * 4)
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values, image_grid_thw=grid,
              mm_token_type_ids=mm_token_type_ids)
    h.remove()
    return seen["pos"]


def test_vl_position_ids_match_model(vl):
    model, tok = vl
    input_ids, mask, grid = _image_row(tok)
    image_id = model.config.image_token_id
    assert image_id == tok.convert_tokens_to_ids("<|image_pad|>")
    ours = compute_position_ids(input_ids, mask, {"image_grid_thw": grid}, model.model, image_id, None)
    assert ours.shape == (1, 4, input_ids.shape[1])
    expected = _model_positions(model, input_ids, mask, grid)  # (3, 1, L)
    valid = mask[0].bool()
    assert torch.equal(ours[0, 1:, valid], expected[:, 0, valid])
    # row 0: plain text positions over attended tokens
    assert ours[0, 0, valid].tolist() == list(range(int(valid.sum())))
    # the image really bends positions (h/w differ from t inside the image span)
    assert not torch.equal(ours[0, 1], ours[0, 2])


def test_config_only_indexer_matches_model(vl):
    model, tok = vl
    input_ids, mask, grid = _image_row(tok, n_pad_left=0)
    shim = rope_indexer_from_config(model.config)
    a = compute_position_ids(input_ids, mask, {"image_grid_thw": grid}, shim, model.config.image_token_id)
    b = compute_position_ids(input_ids, mask, {"image_grid_thw": grid}, model.model, model.config.image_token_id)
    assert torch.equal(a, b)


def test_text_model_positions(vl):
    _, tok = vl
    ids = torch.tensor([[0, 0, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert compute_position_ids(ids, mask).tolist() == [[0, 0, 0, 1, 2]]
    assert rope_indexer_from_config(build_tiny_qwen3_5(kind="dense").config) is None
