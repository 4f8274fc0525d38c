"""GPU checks of the Megatron engine that run whole programs (the engine's unit checks are pytest -m gpu).

    python scripts/gpu_megatron.py grpo      # (b) 3 GRPO steps through main_ppo --config-name
                                             #     ppo_megatron_trainer: 0.8B-shaped random Qwen3.5, hf rollout,
                                             #     packing, weight sync, checkpoint at step 2, resume, step 3;
                                             #     and 3 steps uninterrupted: resumed step 3 must equal it
    python scripts/gpu_megatron.py parity    # (c) first-step loss and grad norm, Megatron vs FSDP, same weights
                                             #     and batch
    ... --tiny                               # tiny shape (a quick smoke run of the plumbing)
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_grpo_step import build_checkpoint, build_data  # noqa: E402


def _launch(base: list[str], total: int, ckpt: Path, log: Path, work: Path, tag: str) -> int:
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(log), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH", ""), str(REPO)) if x)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *base, f"trainer.default_local_dir={ckpt}",
           f"trainer.total_training_steps={total}"]
    print(f"[megatron grpo] {tag}: launch to step {total}: " + " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=str(work), env=env)
    print(f"[megatron grpo] {tag}: exit {rc} after {time.time() - t0:.1f}s", flush=True)
    return rc


def _steps(log: Path) -> dict[int, dict]:
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return {r["step"]: r["data"] for r in records if any(k.startswith("timing_s/") for k in r["data"])}


def _max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest relative difference over the numeric metrics both steps logged (timings, throughput and memory
    excluded: they measure the machine, not the run)."""
    skip = ("timing_s/", "timing_per_token_ms/", "perf/", "global_seqlen/")
    worst, where = 0.0, "-"
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if k.startswith(skip) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        d = abs(x - y) / max(abs(x), abs(y), 1e-12)
        if d > worst:
            worst, where = d, k
    return worst, where


def grpo(args) -> int:
    """Two steps and a checkpoint, then a second launch that resumes from it and runs the third; with
    ``--compare`` also an uninterrupted run of three steps, whose metrics the resumed run must equal (issue 24:
    Megatron resume equals an uninterrupted run). Steps 1-2 of the two runs start from the same weights and
    data, so their difference is this machine's run-to-run noise; step 3's difference is resume's."""
    work = Path(args.workdir) / ("tiny" if args.tiny else "0p8b")
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, args.tiny, "cuda")
    data = work / "data" / "train.parquet"
    build_data(data, n_rows=64, filler_chars=args.filler_chars)
    import shutil

    base = [
        "--config-name", "ppo_megatron_trainer",
        "trainer.launcher=local", "trainer.device=cuda", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.logger=[console,file]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=2", "trainer.experiment_name=megatron_grpo", "trainer.resume_mode=auto",
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data}", f"data.val_files={data}",
        f"data.train_batch_size={args.batch}", f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.response_length}",
        # Two mini-batches, an entropy bonus and lr 1e-5: the random model scores 0, so without the bonus the
        # gradient is 0 and nothing could differ; with one mini-batch step 3's metrics would all be read before
        # its first Adam step, so a lost optimizer state would not show. Now the second mini-batch of step 3
        # runs on weights moved by the restored Adam moments.
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, args.batch // 2)}",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.megatron.use_remove_padding=true",
        "algorithm.adv_estimator=grpo", *args.extra,
    ]
    runs = {"resumed": work / "ckpt_megatron"}
    if args.compare:
        runs["uninterrupted"] = work / "ckpt_megatron_uninterrupted"
    rcs = {}
    for tag, ckpt in runs.items():
        shutil.rmtree(ckpt, ignore_errors=True)  # each run must start fresh; the resumed one then resumes
        log = ckpt.with_suffix(".jsonl")
        if log.exists():
            log.unlink()
        totals = (2, 3) if tag == "resumed" else (3,)
        rcs[tag] = []
        for total in totals:
            rcs[tag].append(_launch(base, total, ckpt, log, work, tag))
            if rcs[tag][-1]:
                break
    steps = {tag: _steps(ckpt.with_suffix(".jsonl")) for tag, ckpt in runs.items()}
    keys = ["timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor", "timing_s/step",
            "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean", "response_length/mean"]
    print("\n=== (b) GRPO through main_ppo --config-name ppo_megatron_trainer (steps 1-2, checkpoint, resume, 3) ===")
    print("| run | step | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 2))
    for tag, by_step in steps.items():
        for step, d in sorted(by_step.items()):
            print(f"| {tag} | {step} | " + " | ".join(f"{d[k]:.6g}" if isinstance(d.get(k), (int, float)) else "-"
                                                      for k in keys) + " |")
    saved = sorted(p.name for p in runs["resumed"].glob("global_step_*")) if runs["resumed"].exists() else []
    print(f"checkpoints: {saved}; launches: {rcs}", flush=True)
    ok = all(rc == 0 for r in rcs.values() for rc in r) and sorted(steps["resumed"]) == [1, 2, 3]
    if args.compare:
        a, b = steps["uninterrupted"], steps["resumed"]
        ok = ok and sorted(a) == [1, 2, 3]
        if ok:
            noise = max(_max_rel_diff(a[s], b[s])[0] for s in (1, 2))
            step3, where = _max_rel_diff(a[3], b[3])
            print(f"[megatron grpo] steps 1-2, uninterrupted vs the run that is interrupted later (run-to-run noise): "
                  f"max rel diff {noise:.3g}; step 3, uninterrupted vs resumed: max rel diff {step3:.3g} ({where})",
                  flush=True)
            # resume must add nothing beyond this machine's run-to-run noise (0 where the kernels are
            # deterministic); the floor covers the last digit of fp32 metrics summed in another order
            ok = step3 <= max(args.resume_tol, 10 * noise)
    print(f"[megatron grpo] {'OK' if ok else 'FAILED'}: steps logged " +
          ", ".join(f"{t} {sorted(s)}" for t, s in steps.items()), flush=True)
    return 0 if ok else 1


def parity(args) -> int:
    """One train_batch of the PPO policy loss on FSDP2 and on Megatron from the same checkpoint and batch."""
    import torch
    import torch.distributed as dist
    from omegaconf import open_dict

    from verl.protocol import DataProto
    from verl.trainer.config.checks import compose_config
    from verl.workers.actor.ppo_actor import PolicyLoss
    from verl.workers.engine_workers import build_engine

    work = Path(args.workdir) / ("tiny" if args.tiny else "0p8b")
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, args.tiny, "cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    common = ["actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
              "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.optim.lr=1e-6",
              "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.entropy_coeff=0.0"]
    runs = {}
    batch = _parity_batch(str(model_dir), n=args.parity_seqs, seed=0)
    for name, cfg_name, extra in (
        ("fsdp2", "ppo_trainer", ["actor_rollout_ref.model.use_remove_padding=true"]),
        # (activation recompute changes memory, not numbers: FSDP's gradient checkpointing vs none here)
        ("megatron", "ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.use_remove_padding=true"]),
    ):
        arr = compose_config(cfg_name, common + extra, validate=False).actor_rollout_ref
        with open_dict(arr.actor):
            arr.actor.ppo_mini_batch_size = args.parity_seqs
        engine = build_engine(arr.actor, arr.model, "actor", trainable=True)
        t0 = time.time()
        engine.initialize()
        data = DataProto.from_dict(tensors=dict(batch), meta_info={"temperature": 1.0, "micro_batch_size": 4,
                                                                   "use_dynamic_bsz": False})
        metrics = engine.train_batch(data, PolicyLoss(arr.actor), outputs=("log_probs", "entropy"))
        runs[name] = {"pg_loss": metrics["actor/pg_loss"], "entropy": metrics.get("actor/entropy", float("nan")),
                      "grad_norm": metrics["grad_norm"], "init_s": time.time() - t0}
        print(f"[parity] {name}: {runs[name]}", flush=True)
        del engine
        torch.cuda.empty_cache()
    f, m = runs["fsdp2"], runs["megatron"]
    print("\n=== (c) first step, same weights and batch: FSDP2 vs Megatron (bf16) ===")
    print("| engine | pg_loss | entropy | grad_norm |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['pg_loss']:.6f} | {r['entropy']:.6f} | {r['grad_norm']:.6f} |")
    rel_loss = abs(f["pg_loss"] - m["pg_loss"]) / max(abs(f["pg_loss"]), 1e-8)
    rel_norm = abs(f["grad_norm"] - m["grad_norm"]) / max(abs(f["grad_norm"]), 1e-8)
    rel_ent = abs(f["entropy"] - m["entropy"]) / max(abs(f["entropy"]), 1e-8)
    print(f"relative difference: pg_loss {rel_loss:.2e}, entropy {rel_ent:.2e}, grad_norm {rel_norm:.2e}", flush=True)
    return 0


def _parity_batch(model_dir: str, n: int, seed: int) -> dict:
    """A GRPO-like batch: left-padded prompts, right-padded responses, group-normalised advantages."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt, response = 256, 256
    ids = torch.randint(0, min(vocab, 50000), (n, prompt + response), generator=g)
    mask = torch.zeros(n, prompt + response, dtype=torch.long)
    for i in range(n):
        p = int(torch.randint(64, prompt + 1, (1,), generator=g))
        r = int(torch.randint(16, response + 1, (1,), generator=g))
        mask[i, prompt - p: prompt + r] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp_mask = mask[:, prompt:].clone()
    adv = torch.randn(n, 1, generator=g).expand(n, response) * resp_mask
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": pos, "responses": (ids * mask)[:, prompt:],
            "response_mask": resp_mask, "old_log_probs": -torch.rand(n, response, generator=g) * 12 * resp_mask,
            "advantages": adv.contiguous()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["grpo", "parity"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--workdir", default="/tmp/verl_megatron")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--filler-chars", type=int, default=300)
    p.add_argument("--max-prompt-length", type=int, default=512)
    p.add_argument("--response-length", type=int, default=128)
    p.add_argument("--parity-seqs", type=int, default=8)
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="grpo: also run 3 steps uninterrupted and require the resumed step 3 to equal it")
    p.add_argument("--resume-tol", type=float, default=1e-6, help="grpo --compare: relative tolerance floor")
    p.add_argument("extra", nargs="*", help="grpo: more main_ppo overrides (key=value)")
    args = p.parse_args(argv)
    return grpo(args) if args.what == "grpo" else parity(args)


if __name__ == "__main__":
    sys.exit(main())
