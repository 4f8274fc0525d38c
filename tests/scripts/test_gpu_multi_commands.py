"""The several-GPU script (scripts/gpu_multi.py, run by scripts/gpu_multi.sh on a 2-GPU host) stays runnable:
every main_ppo command it launches composes and validates against today's config, including the Megatron
parallel sizes against the tiny dense and MoE checkpoints it builds (TP=2 needs the KV heads to divide, EP=2
the experts, PP=2 the layers)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_multi_gpu_command_composes_and_validates(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_multi.py", "check", "--device", "cpu",
                           "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "every command composes and validates" in proc.stdout


def test_an_invalid_layout_would_be_caught(tmp_path):
    """The check is not vacuous: the same command with TP=4 fails (more than the tiny model's 2 KV heads and
    2 Gated DeltaNet key heads, and more than the 2 GPUs)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_multi

    from verl.trainer.config.checks import ConfigValidationError
    from verl.trainer.main_ppo import load_config

    model_dir, data = gpu_multi._assets(tmp_path, "dense")
    overrides = gpu_multi._megatron_overrides(model_dir, data, tmp_path / "ckpt", "cpu", 2,
                                              ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    try:
        load_config(overrides)
    except ConfigValidationError as err:
        assert "tensor_model_parallel_size=4 does not divide num_key_value_heads" in str(err)
    else:
        raise AssertionError("TP=4 on a model with 2 KV heads validated")


def test_pp2ep2_case_dispatches_to_spread_replicas(tmp_path):
    """The 4-GPU case PP=2 EP=2: it validates, and the controller's layout for it sends replica 0's chunk to
    ranks 0 and 2 (one per pipeline stage) and collects from rank 2, the last stage."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_multi

    from verl.trainer.main_ppo import load_config, role_dp_layouts
    from verl.workers.engine_workers import ActorRolloutRefWorker

    kind, n_gpus, extra = gpu_multi._megatron_cases()["pp2ep2"]
    assert (kind, n_gpus) == ("moe", 4)
    model_dir, data = gpu_multi._assets(tmp_path, kind)
    cfg = load_config(gpu_multi._megatron_overrides(model_dir, data, tmp_path / "ckpt", "cpu", n_gpus, extra))
    layout = role_dp_layouts(cfg, {"actor_rollout": (ActorRolloutRefWorker, (), {})})["actor_rollout"]
    assert layout.replica_of == (0, 1, 0, 1) and layout.collect_from == (2, 3)


def test_fsdp_part_on_cpu_two_ranks_equal_one(tmp_path):
    """The script's FSDP part on CPU (fp32): the demo's first step on 2 data-parallel ranks (Ray) gives the 1-rank
    step's grad norm and entropy (to 1e-4), and a non-zero gradient (the script refuses a vacuous comparison).
    The 1-rank reference runs in process (the same FSDP2 engine without a second Ray start; the Ray launcher's
    one-rank run is the demo test's)."""
    proc = subprocess.run([sys.executable, "scripts/gpu_multi.py", "fsdp", "--device", "cpu", "--one-rank-launcher",
                           "local", "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[multi fsdp] OK" in proc.stdout
