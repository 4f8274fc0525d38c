"""RLHFDataset with a tiny Qwen3.5-VL model: the processor renders and expands images, and position ids are the
model's own mRoPE ids in the (4, L) layout (text row, then t/h/w), also for text-only rows of a VL model."""

import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

REPO = Path(__file__).resolve().parents[3]


def load_example():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_vl_images", REPO / "examples" / "data_preprocess" / "make_tiny_vl_images.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.utils.tokenizer import load_tokenizer_and_processor

    root = tmp_path_factory.mktemp("vl")
    model = build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    tok, proc = load_tokenizer_and_processor(OmegaConf.create({"path": str(root / "model")}))
    ex = load_example()
    rows = ex.make_rows(4, seed=0, split="train")  # 16x16, 24x16, 16x24, 32x32 images
    text_row = {**rows[0], "prompt": [{"role": "user", "content": "Say r."}], "images": None}
    path = ex.write_parquet(rows + [text_row], str(root / "train.parquet"))
    return model, tok, proc, path


def _dataset(vl, **kw):
    _, tok, proc, path = vl
    return RLHFDataset(path, tok, OmegaConf.create({"max_prompt_length": 96}), processor=proc, **kw)


def _model_positions(model, input_ids, mask, mm):
    """The (3, 1, L) position ids the model's own forward hands its language model."""
    seen = {}

    def hook(_module, _args, kwargs):
        seen["pos"] = kwargs["position_ids"]

    h = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    types = (input_ids == model.config.image_token_id).int()
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=mask, mm_token_type_ids=types, **mm)
    finally:
        h.remove()
    return seen["pos"]


def test_processor_without_torchvision_takes_frames_and_pickles(vl):
    from verl.utils.frames_video_processor import FramesVideoProcessor

    _, tok, proc, _ = vl
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert isinstance(proc.video_processor, FramesVideoProcessor)  # transformers' needs torchvision
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    clone = pickle.loads(pickle.dumps(proc))
    assert type(clone).__name__ == "Qwen3VLProcessor" and clone.tokenizer.vocab == tok.vocab
    assert isinstance(clone.video_processor, FramesVideoProcessor)
    out = proc(text=["<|video_pad|>"], videos=[torch.zeros(2, 3, 16, 16)], return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[1, 4, 4]]


def test_image_rows_get_the_models_own_mrope_ids(vl):
    model, tok, _, _ = vl
    ds = _dataset(vl)
    image_id = model.config.image_token_id
    for i, n_tokens in enumerate([4, 6, 6, 16]):
        s = ds[i]
        ids, mask, pos = s["input_ids"], s["attention_mask"], s["position_ids"]
        assert pos.shape == (4, 96)
        assert int((ids == image_id).sum()) == n_tokens  # expanded to grid_t*h*w / merge^2
        assert s["raw_prompt_ids"].count(image_id) == 1  # engines expand it themselves
        mm = s["multi_modal_inputs"]
        assert set(mm) == {"pixel_values", "image_grid_thw"}  # mm_token_type_ids is per unpadded token: dropped
        expected = _model_positions(model, ids[None], mask[None], mm)
        valid = mask.bool()
        assert torch.equal(pos[1:, valid], expected[:, 0, valid])
        assert pos[0, valid].tolist() == list(range(int(valid.sum())))
        assert torch.equal(pos[:, ~valid], torch.zeros_like(pos[:, ~valid]))
        assert not torch.equal(pos[1], pos[2])  # the image bends h vs t
        # the helper the agent loop uses gives the same ids
        from verl.experimental.agent_loop import compute_position_ids

        again = compute_position_ids(ids[None], mask[None], mm, model.model, image_id, None)
        assert torch.equal(again[0], pos)


def test_text_row_of_vl_model_matches_layout_and_collates(vl):
    ds = _dataset(vl)
    text = ds[4]
    valid = text["attention_mask"].bool()
    assert text["position_ids"].shape == (4, 96)
    for r in range(4):
        assert text["position_ids"][r, valid].tolist() == list(range(int(valid.sum())))
    assert text["multi_modal_data"] == {} and text["multi_modal_inputs"] == {}
    batch = collate_fn([ds[i] for i in range(5)])
    assert batch["position_ids"].shape == (5, 4, 96)
    assert batch["multi_modal_inputs"][4] == {}


def test_explicit_model_config_and_pickling(vl, tmp_path):
    model, tok, proc, path = vl
    # A tokenizer saved elsewhere (no config.json next to it): the model config must then be given.
    other_tok = type(tok).from_pretrained(tok.name_or_path)
    other_tok.save_pretrained(tmp_path / "tok")
    other_tok = type(tok).from_pretrained(tmp_path / "tok")
    cfg = OmegaConf.create({"max_prompt_length": 96})
    plain = RLHFDataset(path, other_tok, cfg, processor=proc)
    assert plain.rope_indexer is None and plain[0]["position_ids"].shape == (96,)
    given = RLHFDataset(path, other_tok, cfg, processor=proc, model_config=model.config)
    ref = _dataset(vl)
    assert torch.equal(given[3]["position_ids"], ref[3]["position_ids"])
    clone = pickle.loads(pickle.dumps(given))
    assert torch.equal(clone[3]["position_ids"], ref[3]["position_ids"])


def test_text_model_keeps_plain_positions(tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    build_tiny_qwen3_5(tmp_path / "m", kind="dense")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    ex = load_example()
    rows = [{**r, "images": None, "prompt": [{"role": "user", "content": "hi"}]} for r in ex.make_rows(2, 0, "t")]
    path = ex.write_parquet(rows, str(tmp_path / "t.parquet"))
    ds = RLHFDataset(path, tok, OmegaConf.create({"max_prompt_length": 32}))
    s = ds[0]
    assert s["position_ids"].shape == (32,) and "multi_modal_data" not in s
