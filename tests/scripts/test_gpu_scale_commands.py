"""The real-size script (scripts/gpu_scale.py, run by scripts/gpu_scale.sh on a GPU host) stays runnable: both
main_ppo commands compose and validate against today's config, and the EOS calibration that gives a random
checkpoint its long-tailed response lengths does what it says."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_every_scale_command_composes_and_validates(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_scale.py", "check", "--workdir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "every command composes and validates" in proc.stdout


def _mean_eos_prob(model, eos_id, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=g)
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids).logits.float(), -1)[..., eos_id].mean().item()


def test_eos_calibration_sets_the_mean_stop_probability_on_unseen_sequences():
    sys.path.insert(0, str(REPO / "scripts"))
    import transformers as tf

    import gpu_scale

    cfg = gpu_scale._config("tiny_dense", None)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg).eval()
    before = _mean_eos_prob(model, cfg.eos_token_id, seed=5)
    alpha, k = gpu_scale.calibrate_eos(model, cfg.eos_token_id, mean_len=20.0, device="cpu")
    after = _mean_eos_prob(model, cfg.eos_token_id, seed=5)  # other sequences than the calibration's
    assert before < 1 / 200  # a random model almost never stops (1 in the vocabulary)
    assert 1 / 40 < after < 1 / 10, after  # ~1/20, within a factor 2 on sequences it was not fitted to
    row = model.lm_head.weight[cfg.eos_token_id]
    assert abs(row[k].item() - alpha) < 1e-5 * alpha and row.count_nonzero().item() == 1


def test_eos_refit_on_sampled_responses_hits_the_mean_length():
    """The probe fits the stop probability on random ids; the refit prices the model's own samples (EOS
    suppressed), so the capped mean length of real sampled responses lands on the aim."""
    sys.path.insert(0, str(REPO / "scripts"))
    import transformers as tf

    import gpu_scale

    cfg = gpu_scale._config("tiny_dense", None)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg).eval()
    _, k = gpu_scale.calibrate_eos(model, cfg.eos_token_id, mean_len=30.0, device="cpu")
    alpha, _ = gpu_scale.refine_eos_on_samples(model, cfg.eos_token_id, k, 30.0, 64, "cpu", samples=64, tokens=64,
                                               prompt_len=16)
    assert model.lm_head.weight[cfg.eos_token_id, k].item() == pytest.approx(alpha)
    prompts = torch.randint(3, cfg.vocab_size, (128, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=64, eos_token_id=cfg.eos_token_id,
                             pad_token_id=cfg.pad_token_id)
    lengths = [r.index(cfg.eos_token_id) + 1 if cfg.eos_token_id in r else 64 for r in out[:, 16:].tolist()]
    assert 30.0 / 1.25 < sum(lengths) / len(lengths) < 30.0 * 1.25, sum(lengths) / len(lengths)


def test_eos_refit_on_the_runs_own_prompts(tmp_path):
    """With the run's prompts (the dataset's rows as the RL dataset renders them), the refit prices the context
    the rollout sees: responses to other rows of the same data land on the aimed mean."""
    sys.path.insert(0, str(REPO / "scripts"))
    import transformers as tf

    import gpu_scale
    from gpu_grpo_step import build_data
    from verl.models.tiny import build_tiny_tokenizer

    data = tmp_path / "train.parquet"
    build_data(data, n_rows=160, filler_chars=40)
    tok = build_tiny_tokenizer()
    rows = gpu_scale.dataset_prompts(data, tok, 160)
    assert rows.shape[0] == 160 and rows.shape[1] >= 40
    assert tok.decode(rows[0, -12:].tolist()).endswith("<|im_start|>assistant\n")  # the generation prompt
    cfg = gpu_scale._config("tiny_dense", None)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg).eval()
    _, k = gpu_scale.calibrate_eos(model, cfg.eos_token_id, mean_len=30.0, device="cpu")
    alpha, _ = gpu_scale.refine_eos_on_samples(model, cfg.eos_token_id, k, 30.0, 64, "cpu", tokens=64,
                                               prompts=rows[:64])
    assert model.lm_head.weight[cfg.eos_token_id, k].item() == pytest.approx(alpha)
    held_out = rows[64:]
    with torch.no_grad():
        out = model.generate(held_out, attention_mask=torch.ones_like(held_out), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=64, eos_token_id=cfg.eos_token_id,
                             pad_token_id=cfg.pad_token_id)
    n = held_out.shape[1]
    lengths = [r.index(cfg.eos_token_id) + 1 if cfg.eos_token_id in r else 64 for r in out[:, n:].tolist()]
    assert 30.0 / 1.25 < sum(lengths) / len(lengths) < 30.0 * 1.25, sum(lengths) / len(lengths)

