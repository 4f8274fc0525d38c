"""VL SFT through the trainer and the FSDP engine: image conversations (with a text-only row mixed in) train,
and packing them gives the padded batch's loss (mRoPE positions and vision inputs survive the packing)."""

import json

import pytest

from tests.trainer.sft.test_sft_trainer import run_in_process

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory):
    import random

    from PIL import Image

    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    root = tmp_path_factory.mktemp("sftvl")
    build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    rng = random.Random(0)
    rows = []
    for i in range(15):
        a, b = rng.choice(sorted(COLORS)), rng.choice(sorted(COLORS))
        paths = []
        for name, color in ((f"a{i}", a), (f"b{i}", b)):
            Image.new("RGB", (16 + 8 * (i % 3), 16), COLORS[color]).save(root / f"{name}.png")
            paths.append({"path": str(root / f"{name}.png")})
        rows.append({"messages": [{"role": "user", "content": "<image><image> colors?"},
                                  {"role": "assistant", "content": f"{a} {b}"}], "images": paths})
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                 "images": []})
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return root


def test_vl_packed_equals_padded_and_learns(vl_data, tmp_path):
    common = [f"model.path={vl_data}/model", f"data.train_files={vl_data}/train.jsonl", "data.train_batch_size=8",
              "data.micro_batch_size_per_gpu=4", "data.use_dynamic_bsz=false", "data.num_workers=0",
              "data.max_length=128", "data.shuffle=false", "trainer.device=cpu", "trainer.total_training_steps=3",
              "trainer.resume_mode=disable", "optim.lr=3e-3", "optim.weight_decay=0"]
    packed = run_in_process(tmp_path / "p", [*common, "data.pad_mode=no_padding", "model.use_remove_padding=true"])
    padded = run_in_process(tmp_path / "r", [*common, "data.pad_mode=right", "model.use_remove_padding=false"])
    for key in ("train/loss", "train/grad_norm"):
        a = [h[key] for h in packed["history"]]
        b = [h[key] for h in padded["history"]]
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), key
    losses = [h["train/loss"] for h in packed["history"]]
    assert losses[-1] < losses[0]
