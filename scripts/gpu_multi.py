"""The several-GPU checks (one host, Ray launcher): FSDP2 on 1 vs 2 GPUs, and Megatron GRPO at TP / EP / PP = 2
and at PP = 2 with EP = 2 (4 GPUs).

    python scripts/gpu_multi.py fsdp        # the demo's first GRPO step on 1 and on 2 GPUs (FSDP2, Ray): same
                                            # pg_loss / grad_norm / entropy within the stated tolerance;
                                            # tokens/s per GPU (perf/throughput) of each
    python scripts/gpu_multi.py megatron    # 3 GRPO steps through main_ppo --config-name ppo_megatron_trainer on
                                            # 2 GPUs with TP=2 (dense), EP=2 (MoE) and PP=2 (dense), and on 4
                                            # GPUs with PP=2 EP=2 (MoE: expert * expert-tensor parallel != TP under
                                            # a pipeline, so data replicas are not consecutive ranks; skipped with
                                            # a line on a host with fewer GPUs); every step syncs the sharded
                                            # weights into the hf rollout, whose coverage check fails the run if a
                                            # weight is missed
    python scripts/gpu_multi.py check       # compose and validate every command above (CPU, no run)

``fsdp`` also runs on CPU (``--device cpu``: Ray workers on CPU, fp32), where the two layouts must agree to
1e-4 (``--one-rank-launcher local`` runs the 1-rank reference in process, skipping a Ray start: the tests do,
on a 2-core CPU). Both layouts see the same batch: the rollout is greedy (``do_sample=false``), so responses do
not depend on each rank's sampling seed, and the estimator is REINFORCE++ (batch-whitened returns), whose
advantages are not zero for identical responses as GRPO's would be; an entropy bonus gives the step a gradient
even when every reward is 0 (the untrained demo model). Megatron's packed log-probs at TP / EP = 2 against Hugging
Face are a pytest (tests/models/mcore/test_mcore_qwen3_5_parallel_gpu.py); scripts/gpu_multi.sh runs both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARITY_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "response_length/mean")


def _fsdp_overrides(n_gpus: int, device: str, log_dir: Path, launcher: str = "ray") -> list[str]:
    return [
        "--config-name", "demo", f"trainer.launcher={launcher}", f"trainer.device={device}", "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={n_gpus}", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,file]",
        f"trainer.default_local_dir={log_dir / 'ckpt'}",
        "actor_rollout_ref.rollout.do_sample=false", "algorithm.adv_estimator=reinforce_plus_plus",
        # One policy update per step (the demo's 16 prompts x 8 responses): with two updates, each rank would
        # take its own first half of its shard, so the 2-GPU first update would see other samples than the
        # 1-GPU one. Micro-batches of 32: 4 on one GPU, 2 per GPU on two.
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        # the untrained demo model's greedy answers all score 0, so the advantages are 0 too: the entropy bonus
        # gives the step a gradient to compare
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ]


def _megatron_cases() -> dict[str, tuple[str, int, list[str]]]:
    """name -> (model kind, GPUs, overrides)."""
    m = "actor_rollout_ref.actor.megatron"
    return {
        "tp2": ("dense", 2, [f"{m}.tensor_model_parallel_size=2"]),
        "ep2": ("moe", 2, [f"{m}.expert_model_parallel_size=2"]),
        "pp2": ("dense", 2, [f"{m}.pipeline_model_parallel_size=2"]),
        # Pipeline-outermost ranks: replica 0 is ranks 0 and 2 (stage 0, stage 1), replica 1 ranks 1 and 3; the
        # experts of each stage are split over its two ranks. EP * ETP (2) != TP (1) under PP: the layout the
        # engine used to refuse.
        "pp2ep2": ("moe", 4, [f"{m}.pipeline_model_parallel_size=2", f"{m}.expert_model_parallel_size=2",
                              f"{m}.expert_tensor_parallel_size=1"]),
    }


def _megatron_overrides(model_dir: Path, data: Path, ckpt: Path, device: str, n_gpus: int,
                        extra: list[str]) -> list[str]:
    return [
        "--config-name", "ppo_megatron_trainer", "trainer.launcher=ray", f"trainer.device={device}",
        "trainer.nnodes=1", f"trainer.n_gpus_per_node={n_gpus}", "trainer.total_training_steps=3",
        "trainer.logger=[console,file]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.default_local_dir={ckpt}",
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data}", f"data.val_files={data}",
        "data.train_batch_size=8", "data.max_prompt_length=512", "data.max_response_length=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.megatron.use_remove_padding=true", "algorithm.adv_estimator=grpo", *extra,
    ]


def _run_main_ppo(overrides: list[str], log: Path, cwd: Path, timeout: int) -> tuple[int, list[dict]]:
    if log.exists():
        log.unlink()
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(log), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH", ""), str(REPO)) if x)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    print("[multi] " + " ".join(cmd), flush=True)
    t0 = time.time()
    try:
        rc = subprocess.call(cmd, cwd=str(cwd), env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"[multi] exit {rc} after {time.time() - t0:.1f}s", flush=True)
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return rc, [r for r in records if "actor/pg_loss" in r["data"]]


def fsdp(args) -> int:
    work = Path(args.workdir) / "fsdp"
    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    for n in (1, 2):
        launcher = args.one_rank_launcher if n == 1 else "ray"
        rc, steps = _run_main_ppo(_fsdp_overrides(n, args.device, work / f"gpus{n}", launcher),
                                  work / f"gpus{n}.jsonl", work, args.timeout)
        if rc or not steps:
            print(f"[multi fsdp] the {n}-GPU run failed (exit {rc})", flush=True)
            return 1
        runs[n] = steps[0]["data"]
    tol = args.tol if args.tol is not None else (1e-4 if args.device == "cpu" else 2e-2)
    print(f"\n=== FSDP2, first GRPO step of the demo on 1 vs 2 {args.device.upper()}s (same greedy batch) ===")
    print("| metric | 1 GPU | 2 GPUs | relative difference |")
    print("|---|---:|---:|---:|")
    worst = 0.0
    for key in PARITY_KEYS:
        a, b = runs[1][key], runs[2][key]
        rel = abs(a - b) / max(abs(a), 1e-8)
        if key.startswith("actor/"):
            worst = max(worst, rel)
        print(f"| {key} | {a:.6g} | {b:.6g} | {rel:.2e} |")
    for key in ("perf/throughput", "perf/time_per_step"):
        print(f"| {key} | {runs[1][key]:.6g} | {runs[2][key]:.6g} | - |")
    ok = worst <= tol and runs[1]["actor/grad_norm"] > 0  # a zero gradient would compare nothing
    print(f"[multi fsdp] {'OK' if ok else 'FAILED'}: worst actor difference {worst:.2e} (tolerance {tol:.0e}; "
          "perf/throughput is tokens/s per GPU)", flush=True)
    return 0 if ok else 1


def _assets(work: Path, kind: str) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_grpo_step import build_data

    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    model_dir = work / f"tiny_{kind}"
    if not (model_dir / "config.json").exists():
        build_tiny_qwen3_5(str(model_dir), kind=kind, seed=0)
    data = work / "data" / "train.parquet"
    if not data.exists():
        build_data(data, n_rows=64, filler_chars=100)
    return model_dir, data


def megatron(args) -> int:
    work = Path(args.workdir) / "megatron"
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    have = _gpu_count() if args.device == "cuda" else None
    for name, (kind, n_gpus, extra) in _megatron_cases().items():
        if args.cases and name not in args.cases:
            continue
        if have is not None and have < n_gpus:
            print(f"[multi megatron] SKIPPED {name}: needs {n_gpus} GPUs, this host has {have}", flush=True)
            results[name] = (None, n_gpus, [])
            continue
        model_dir, data = _assets(work, kind)
        rc, steps = _run_main_ppo(
            _megatron_overrides(model_dir, data, work / f"ckpt_{name}", args.device, n_gpus, extra),
            work / f"{name}.jsonl", work, args.timeout)
        results[name] = (rc, n_gpus, steps)
    print("\n=== Megatron GRPO: 3 steps per layout (hf rollout, weight sync with coverage check) ===")
    print("| layout | GPUs | exit | steps | pg_loss (1, 2, 3) | grad_norm (1, 2, 3) |")
    print("|---|---:|---:|---|---|---|")
    ok = True
    for name, (rc, n_gpus, steps) in results.items():
        if rc is None:
            print(f"| {name} | {n_gpus} | skipped (fewer GPUs) | | | |")
            continue
        pg = ", ".join(f"{s['data']['actor/pg_loss']:.4g}" for s in steps)
        gn = ", ".join(f"{s['data']['actor/grad_norm']:.4g}" for s in steps)
        print(f"| {name} | {n_gpus} | {rc} | {[s['step'] for s in steps]} | {pg} | {gn} |")
        ok = ok and rc == 0 and [s["step"] for s in steps] == [1, 2, 3]
    print(f"[multi megatron] {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def check(args) -> int:
    """Compose and validate every command of this script (no run): they must stay valid as the config moves."""
    from verl.trainer.main_ppo import load_config

    work = Path(args.workdir) / "check"
    for n in (1, 2):
        load_config(_fsdp_overrides(n, args.device, work, args.one_rank_launcher if n == 1 else "ray"))
    for name, (kind, n_gpus, extra) in _megatron_cases().items():
        model_dir, data = _assets(work, kind)
        load_config(_megatron_overrides(model_dir, data, work / f"ckpt_{name}", args.device, n_gpus, extra))
    print("[multi check] every command composes and validates", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["fsdp", "megatron", "check"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--workdir", default="/tmp/verl_multi")
    p.add_argument("--timeout", type=int, default=540, help="seconds per main_ppo launch")
    p.add_argument("--tol", type=float, default=None, help="relative tolerance (default: 1e-4 CPU, 2e-2 GPU bf16)")
    # The 1-rank reference step is the same FSDP2 engine whichever launcher starts it; `local` (in process) skips
    # starting a Ray node and an actor, which is most of that launch's time on a small CPU (the tests use it).
    p.add_argument("--one-rank-launcher", default="ray", choices=["ray", "local"],
                   help="launcher of the fsdp part's 1-GPU run (default ray; the 2-GPU run always uses ray)")
    p.add_argument("--cases", nargs="*", default=None, help="megatron layouts to run (tp2 ep2 pp2 pp2ep2)")
    args = p.parse_args(argv)
    return {"fsdp": fsdp, "megatron": megatron, "check": check}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
