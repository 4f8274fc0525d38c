"""Vision-language GRPO on CPU with a tiny Qwen3.5-VL model and a batch of images.

1. Component level: dataset -> hf rollout (HF generate with pixel_values / image_grid_thw) -> the actor's
   log-probs on the packed (remove-padding) and the padded path. The actor must reproduce the rollout's own
   log-probs, which holds only if both see the same mRoPE positions and image embeddings.
2. ``python -m verl.trainer.main_ppo`` for 2 GRPO steps on an image parquet, with either actor path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from tests.trainer.e2e_utils import run_main_ppo, train_records
from tests.utils.dataset.test_rl_dataset_vl import load_example


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    root = tmp_path_factory.mktemp("vl_e2e")
    build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    ex = load_example()
    train = ex.write_parquet(ex.make_rows(4, seed=0, split="train"), str(root / "train.parquet"))
    return root, str(root / "model"), train


def test_rollout_and_actor_log_probs_agree(assets):
    from verl.models.registry import load_hf_model
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.protocol import DataProto
    from verl.trainer.config.checks import compose_config
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from tests.engine_utils import make_engine, single_rank_gloo
    from verl.workers.actor.ppo_actor import PPOActor
    from verl.utils.tokenizer import load_tokenizer_and_processor
    from verl.workers.rollout.batching import generate_sequences
    from verl.workers.rollout.hf_rollout import HFRollout

    _, model_dir, train = assets
    tok, proc = load_tokenizer_and_processor(OmegaConf.create({"path": model_dir}))
    ds = RLHFDataset(train, tok, OmegaConf.create({"max_prompt_length": 96}), processor=proc)
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(4)]))
    assert batch.batch["position_ids"].shape == (4, 4, 96)

    model = load_hf_model(model_dir, dtype=torch.float32)
    apply_monkey_patch(model, use_remove_padding=True)  # padded inputs work with the patch as well
    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=hf"], validate=False).actor_rollout_ref
    with open_dict(cfg):
        cfg.rollout.response_length = 5
        cfg.rollout.temperature = 1.0
    engine = HFRollout(cfg.rollout, None, tok, module=model, processor=proc)
    torch.manual_seed(0)
    gen = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"],
                       non_tensor_batch_keys=["raw_prompt_ids", "multi_modal_data", "multi_modal_inputs"])
    gen.meta_info = {"seed": 0}
    out = generate_sequences(engine, gen, cfg.rollout, [tok.eos_token_id], tok.pad_token_id)
    assert out.batch["position_ids"].shape == (4, 4, 96 + 5)
    # responses continue every mRoPE row from the prompt's last position
    pos = out.batch["position_ids"]
    assert torch.equal(pos[..., 96:] - pos[..., 95:96], torch.arange(1, 6).expand(4, 4, 5))

    out.non_tensor_batch["multi_modal_inputs"] = batch.non_tensor_batch["multi_modal_inputs"]
    out.meta_info = {"temperature": 1.0, "micro_batch_size": 3}  # 3: micro-batches of 3 and 1 images
    mask = out.batch["response_mask"].bool()
    assert mask.any()
    rollout_lp = out.batch["rollout_log_probs"][mask]
    with open_dict(cfg):
        cfg.model.path = model_dir
    with single_rank_gloo():
        for rmpad in (True, False):  # the reference engine: the same checkpoint, forward only
            with open_dict(cfg):
                cfg.model.use_remove_padding = rmpad
            actor = PPOActor(cfg.ref, make_engine(cfg.ref, cfg.model, role="ref"))
            lp, ent = actor.compute_log_prob(out, calculate_entropy=True)
            assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
            torch.testing.assert_close(lp[mask], rollout_lp, atol=2e-4, rtol=1e-4, msg=f"rmpad={rmpad}")

        # without the images the same tokens score differently: the pixels really reach the model
        blank = [{**m, "pixel_values": torch.zeros_like(m["pixel_values"])}
                 for m in batch.non_tensor_batch["multi_modal_inputs"]]
        out.non_tensor_batch["multi_modal_inputs"] = np.array(blank, dtype=object)
        lp_zero, _ = actor.compute_log_prob(out)
        assert not torch.allclose(lp_zero[mask], rollout_lp, atol=1e-3)


@pytest.mark.parametrize("rmpad", [True, False])
def test_main_ppo_two_grpo_steps_with_images(assets, tmp_path, rmpad):
    _, model_dir, train = assets
    overrides = [
        "trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.total_training_steps=2", f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={str(rmpad).lower()}",
        f"data.train_files={train}", f"data.val_files={train}", "data.image_key=images",
        "data.max_prompt_length=96", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    _, rec = run_main_ppo(tmp_path, overrides, env_extra={"OMP_NUM_THREADS": "1"})
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                    "critic/advantages/mean", "response_length/mean"):
            assert math.isfinite(s[key]), key
        # Every prompt carries its expanded image tokens: the text alone is 40 tokens, images add 3..15.
        assert s["prompt_length/min"] >= 43 and s["prompt_length/max"] <= 55
        if s["critic/advantages/max"] > 0:  # a group with different rewards: the update had a gradient
            assert s["actor/grad_norm"] > 0
