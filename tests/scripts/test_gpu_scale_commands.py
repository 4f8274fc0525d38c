"""The real-size script (scripts/gpu_scale.py, run by scripts/gpu_scale.sh on a GPU host) stays runnable: both
main_ppo commands compose and validate against today's config, and the EOS calibration that gives a random
checkpoint its long-tailed response lengths does what it says."""

import subprocess
import sys
from pathlib import Path

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
