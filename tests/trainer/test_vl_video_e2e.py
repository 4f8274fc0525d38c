"""Video GRPO on CPU with a tiny Qwen3.5-VL model (issue 27: upstream's Qwen3.5-2B video script).

1. Component level: a video dataset row -> the built-in hf rollout (both its decode engine and HF ``generate``)
   -> the actor's log-probs, packed and padded. The actor must reproduce the rollout's own log-probs, which holds
   only if both see the same video embeddings and mRoPE positions; blanking the video pixels changes them.
2. ``python -m verl.trainer.main_ppo`` for 2 GRPO steps on a video parquet with upstream's data keys.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from tests.trainer.e2e_utils import run_main_ppo, train_records

REPO = Path(__file__).resolve().parents[2]
L = 128  # max_prompt_length


def load_video_example():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_vl_videos", REPO / "examples" / "data_preprocess" / "make_tiny_vl_videos.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    root = tmp_path_factory.mktemp("vl_video_e2e")
    build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    ex = load_video_example()
    train = ex.write_parquet(ex.make_rows(4, seed=0, split="train"), str(root / "train.parquet"))
    return root, str(root / "model"), train


@pytest.mark.parametrize("decode_engine", [True, False])
def test_rollout_and_actor_log_probs_agree_on_video_rows(assets, decode_engine):
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
    ds = RLHFDataset(train, tok, OmegaConf.create({"max_prompt_length": L}), processor=proc)
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(4)]))
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    # 4 frames per clip (4; 6 and 8 cut to max_frames=4; 3 padded to 4) = 2 frame pairs; frames end up at the
    # tiny processor's largest size, 32x32 = 4x4 merged tokens: 2 * 16 video tokens per row
    assert ((batch.batch["input_ids"] == video_id).sum(-1) == 32).all()
    assert batch.batch["position_ids"].shape == (4, 4, L)

    model = load_hf_model(model_dir, dtype=torch.float32)
    apply_monkey_patch(model, use_remove_padding=True)
    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=hf"], validate=False).actor_rollout_ref
    with open_dict(cfg):
        cfg.rollout.response_length = 5
        cfg.rollout.temperature = 1.0
    engine = HFRollout(cfg.rollout, None, tok, module=model, processor=proc)
    engine.decode_engine = engine.decode_engine and decode_engine
    assert engine.decode_engine == decode_engine
    torch.manual_seed(0)
    gen = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"],
                       non_tensor_batch_keys=["raw_prompt_ids", "multi_modal_data", "multi_modal_inputs"])
    gen.meta_info = {"seed": 0}
    out = generate_sequences(engine, gen, cfg.rollout, [tok.eos_token_id], tok.pad_token_id)
    assert out.batch["position_ids"].shape == (4, 4, L + 5)

    out.non_tensor_batch["multi_modal_inputs"] = batch.non_tensor_batch["multi_modal_inputs"]
    out.meta_info = {"temperature": 1.0, "micro_batch_size": 3}
    mask = out.batch["response_mask"].bool()
    assert mask.any()
    rollout_lp = out.batch["rollout_log_probs"][mask]
    with open_dict(cfg):
        cfg.model.path = model_dir
    with single_rank_gloo():
        for rmpad in (True, False):
            with open_dict(cfg):
                cfg.model.use_remove_padding = rmpad
            actor = PPOActor(cfg.ref, make_engine(cfg.ref, cfg.model, role="ref"))
            lp, ent = actor.compute_log_prob(out, calculate_entropy=True)
            assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
            torch.testing.assert_close(lp[mask], rollout_lp, atol=2e-4, rtol=1e-4, msg=f"rmpad={rmpad}")

        # the video pixels reach the model: blank frames score the same tokens differently
        blank = [{**m, "pixel_values_videos": torch.zeros_like(m["pixel_values_videos"])}
                 for m in batch.non_tensor_batch["multi_modal_inputs"]]
        out.non_tensor_batch["multi_modal_inputs"] = np.array(blank, dtype=object)
        lp_zero, _ = actor.compute_log_prob(out)
        assert not torch.allclose(lp_zero[mask], rollout_lp, atol=1e-3)


def test_main_ppo_two_grpo_steps_with_videos(assets, tmp_path):
    _, model_dir, train = assets
    overrides = [
        "trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.total_training_steps=2", f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}", f"data.val_files={train}", "data.video_key=videos",
        # upstream's video script sets the Qwen3.5 patch size; the tiny tower's is 4
        "data.image_patch_size=4", f"data.max_prompt_length={L}", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    _, rec = run_main_ppo(tmp_path, overrides, env_extra={"OMP_NUM_THREADS": "1"})
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert math.isfinite(s[key]), key
        # 32 video tokens plus per-pair timestamps and vision markers make every prompt longer than its text
        assert s["prompt_length/min"] >= 40 + 32
