"""The SFT trainer on the FSDP engine's paths: packed (no_padding) batches give the padded batches' loss,
two ranks under torchrun (gloo) give one rank's, and the Hugging Face export (full and LoRA) holds the
trained weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.sft.test_sft_trainer import REPO, _env, run_in_process

SMALL = ["data.train_max_samples=32", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
         "data.val_max_samples=8", "trainer.resume_mode=disable"]


def _steps(result, key):
    return [h[key] for h in result["history"]]


def test_packed_batch_loss_equals_padded(tmp_path):
    packed = run_in_process(tmp_path / "p", [*SMALL, "trainer.total_training_steps=2", "data.pad_mode=no_padding",
                                             "model.use_remove_padding=true"])
    padded = run_in_process(tmp_path / "r", [*SMALL, "trainer.total_training_steps=2", "data.pad_mode=right",
                                             "data.max_length=512", "model.use_remove_padding=false"])
    for key in ("train/loss", "train/grad_norm"):
        assert _steps(packed, key) == pytest.approx(_steps(padded, key), rel=1e-4, abs=1e-5), key


def test_dynamic_batch_size_matches_fixed_micro_batches(tmp_path, monkeypatch):
    """data.use_dynamic_bsz=true (upstream's default; the demo turns it off) splits each rank's batch under the
    token budget instead of by count: the loss is normalised by the global token count, so the losses, grad
    norms and validation loss equal the fixed-size split's."""
    from verl.utils import seqlen_balancing

    splits = []
    original = seqlen_balancing.rearrange_micro_batches

    def recording(batch, *args, **kwargs):  # the engine imports it at call time, so the patch is seen
        micro, groups = original(batch, *args, **kwargs)
        splits.append(len(groups))
        return micro, groups

    monkeypatch.setattr(seqlen_balancing, "rearrange_micro_batches", recording)
    common = [*SMALL, "trainer.total_training_steps=2", "trainer.test_freq=2"]
    fixed = run_in_process(tmp_path / "f", [*common, "data.use_dynamic_bsz=false", "data.micro_batch_size_per_gpu=8"])
    assert splits == []
    dynamic = run_in_process(tmp_path / "d", [*common, "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=1024"])
    # The budget was used, and it split the 8 conversations (a few hundred tokens each) into several parts.
    assert splits and max(splits) > 1, splits
    for key in ("train/loss", "train/grad_norm"):
        assert _steps(dynamic, key) == pytest.approx(_steps(fixed, key), rel=1e-4, abs=1e-5), key
    assert dynamic["history"][-1]["val/loss"] == pytest.approx(fixed["history"][-1]["val/loss"], rel=1e-4)


def _hf_val_loss(model_dir, tmp_path):
    """Mean assistant-token NLL of the demo's first 8 validation rows under a plain HF forward."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.trainer.demo.sft_task import ensure_sft_assets
    from verl.trainer.sft.loss import token_nll_sum
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset, sft_collate_fn

    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = MultiTurnSFTDataset(ensure_sft_assets()["val"], tok, OmegaConf.create({"max_length": 512}), max_samples=8)
    batch = sft_collate_fn([ds[i] for i in range(len(ds))], tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = torch.roll(batch["input_ids"], -1, dims=1)
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    nll, count = token_nll_sum(lp, batch["loss_mask"])
    return float(nll / count)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hf_export_holds_the_trained_weights(tmp_path, lora):
    extra = ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=1e-2"] if lora else []
    result = run_in_process(tmp_path, [*SMALL, *extra, "trainer.total_training_steps=3", "trainer.test_freq=3",
                                       "trainer.save_freq=3",
                                       "checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    export = tmp_path / "ckpt" / "global_step_3" / "huggingface"
    assert (export / "config.json").exists()
    losses = _steps(result, "train/loss")
    assert losses[-1] < losses[0]
    # The exported model scores the validation rows exactly as the engine did after the last step.
    assert _hf_val_loss(str(export), tmp_path) == pytest.approx(result["history"][-1]["val/loss"], rel=1e-4)


def test_two_ranks_match_one(tmp_path):
    """torchrun --nproc_per_node=2 (gloo on CPU) takes the same steps as one process on the same batches."""
    common = ["trainer.total_training_steps=2", "trainer.test_freq=2", "data.train_max_samples=32",
              "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "data.val_max_samples=8",
              "trainer.resume_mode=disable"]
    one = run_in_process(tmp_path / "o1", common)["history"]
    log = tmp_path / "w2.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "verl.trainer.sft_trainer", *common, "trainer.logger=[console,file]",
           f"trainer.default_local_dir={tmp_path}/o2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, VERL_FILE_LOGGER_PATH=str(log)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = [json.loads(line)["data"] for line in log.read_text().splitlines()]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in ("train/loss", "train/grad_norm", "train/global_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    assert two[-1]["val/loss"] == pytest.approx(one[-1]["val/loss"], rel=1e-4)
