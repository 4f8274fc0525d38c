"""Asynchronous RL against the colocated synchronous run, on the same GPUs in one session (issue 26).

Three launches on one host, each ``--steps`` GRPO steps of the same workload (a random-initialised Qwen3.5
checkpoint of the 0.8B shape whose EOS row is calibrated for a long tail: responses up to ``--max-response``,
mean aimed at ``--mean-response``; see ``gpu_scale.calibrate_eos``):

* ``sync``: ``python -m verl.trainer.main_ppo``, every GPU colocated (generate, then train);
* ``one_step``: ``python -m verl.experimental.one_step_off_policy.main_ppo``, half the GPUs train, half generate;
* ``fully_async``: ``python -m verl.experimental.fully_async_policy.fully_async_main``, the same split, with
  ``async_training.staleness_threshold`` and a weight sync every step (``--partial-rollout``: the responses in
  flight at a sync go on with the new weights instead of draining first, ``async_training.partial_rollout``).

Printed per mode: samples/s over steps 2..N (step 1 holds the one-off compilation), the speed-up against
``sync``, and where each pool's GPUs wait: the trainer's wait for samples (``fully_async/trainer/idle_ratio``),
the rollout pool's time with nothing to do (``fully_async/rollouter/idle_ratio``), and inside generation the
share of decode slot-steps that held no live sequence (``1 - slot_steps / (decode_steps x slots)`` from
``perf/hf_engine/*``: the long tail's idle slots), and for ``fully_async`` the most generation chunks in flight
on the rollout pool against the pipeline depth. For ``sync``, generation's share of the step.

    python scripts/gpu_async.py --gpus 2                         # 1 trainer GPU + 1 rollout GPU vs 2 colocated
    python scripts/gpu_async.py --gpus 4 --modes sync,one_step   # 2 + 2
    python scripts/gpu_async.py --tiny --device cpu --gpus 2     # the same path at tiny shapes on the CPU
    python scripts/gpu_async.py --gpus 2 --modes fully_async --partial-rollout --reuse sync   # no drain at syncs
    python scripts/gpu_async.py --build-only; ... --modes sync; ... --modes one_step --reuse sync; ...
        --modes fully_async --reuse sync,one_step                # one mode per device call, one table at the end
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
sys.path.insert(0, str(REPO / "scripts"))

ENTRY = {
    "sync": "verl.trainer.main_ppo",
    "one_step": "verl.experimental.one_step_off_policy.main_ppo",
    "fully_async": "verl.experimental.fully_async_policy.fully_async_main",
}


def overrides(args, mode: str, model: Path, data: Path) -> list[str]:
    p, n, g = args.prompts, args.n, args.gpus
    common = [
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={model}", f"data.train_files={data}",
        f"data.val_files={data}", f"data.max_prompt_length={args.max_prompt}",
        f"data.max_response_length={args.max_response}", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_prompt + args.max_response}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * (args.max_prompt + args.max_response)}",
        f"actor_rollout_ref.rollout.name={args.rollout_name}", f"actor_rollout_ref.rollout.n={n}",
        f"trainer.device={args.device}",
        "trainer.nnodes=1", "trainer.logger=[console,file]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.total_training_steps={args.steps}", "trainer.resume_mode=disable",
    ]
    if mode == "sync":
        return common + [f"trainer.n_gpus_per_node={g}", f"data.train_batch_size={p}",
                         f"actor_rollout_ref.actor.ppo_mini_batch_size={p}"]
    split = [f"trainer.n_gpus_per_node={g // 2}", "rollout.nnodes=1", f"rollout.n_gpus_per_node={g - g // 2}"]
    if mode == "one_step":
        return common + split + [f"data.train_batch_size={p}", f"actor_rollout_ref.actor.ppo_mini_batch_size={p}"]
    # fully async: a trainer step takes require_batches x mini-batch = p prompts, generated in chunks of
    # --chunk-prompts, with --concurrent-samples prompts per rollout replica in flight (chunks submitted ahead
    # share the engine's slots: one chunk at a time, chunks of p / 4 left half the decode slots idle on
    # 2 x H100, 2026-11-26, docs/advance/async_rl.md). Small chunks let several be in flight within one weight
    # version's allowance ((1 + staleness) x a step's chunks, less those left over at each sync): with a whole
    # step per chunk and staleness 0.5 only one fits.
    chunk = args.chunk_prompts or max(1, p // 4)
    return common + split + [
        f"async_training.concurrent_samples_per_replica={args.concurrent_samples or 2 * p // (g - g // 2) or 1}",
        "data.train_batch_size=0", f"data.gen_batch_size={chunk}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, p // 2)}", "async_training.require_batches=2",
        f"async_training.staleness_threshold={args.staleness}", "async_training.trigger_parameter_sync_step=1",
        f"async_training.partial_rollout={str(bool(args.partial_rollout)).lower()}",
        f"rollout.total_rollout_steps={p * (args.steps + 1)}",
    ]


def launch(args, mode: str, model: Path, data: Path, work: Path) -> tuple[int, list[dict]]:
    log = work / f"{mode}.jsonl"
    if log.exists():
        log.unlink()
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(log), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH", ""), str(REPO)) if x)
    cmd = [sys.executable, "-m", ENTRY[mode], *overrides(args, mode, model, data), *args.extra]
    print(f"[async {mode}] " + " ".join(cmd), flush=True)
    t0 = time.time()
    try:
        rc = subprocess.call(cmd, cwd=str(work), env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"[async {mode}] exit {rc} after {time.time() - t0:.0f} s", flush=True)
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return rc, [r for r in records if "timing_s/step" in r["data"]]


def summarize(steps: list[dict], prompts: int, n: int) -> dict:
    """samples/s over steps 2..N, and the idle figures averaged over the same steps."""
    timed = steps[1:] or steps
    secs = sum(r["data"]["timing_s/step"] for r in timed)

    def mean(key):
        vals = [r["data"][key] for r in timed if key in r["data"]]
        return sum(vals) / len(vals) if vals else None

    def total(key):
        return sum(r["data"].get(key, 0.0) for r in timed)

    slot_idle = []
    for r in timed:
        d = r["data"]
        cap = d.get("perf/hf_engine/decode_steps", 0) * d.get("perf/hf_engine/slots", 0)
        if cap:
            slot_idle.append(1 - d["perf/hf_engine/slot_steps"] / cap)
    return dict(steps=len(steps), samples_per_s=prompts * n * len(timed) / secs if secs else 0.0,
                step_s=secs / len(timed) if timed else 0.0, gen_share=mean("timing_s/gen") and
                mean("timing_s/gen") / mean("timing_s/step"), trainer_idle=mean("fully_async/trainer/idle_ratio"),
                rollout_idle=mean("fully_async/rollouter/idle_ratio"),
                slot_idle=sum(slot_idle) / len(slot_idle) if slot_idle else None,
                depth=mean("fully_async/rollouter/pipeline_depth"), in_flight=max(
                    (r["data"].get("fully_async/rollouter/max_chunks_in_flight", 0) for r in timed), default=0),
                response_mean=mean("response_length/mean"), response_max=max(
                    (r["data"].get("response_length/max", 0) for r in timed), default=0),
                # weight syncs on the rollout pool: paused chunks in flight (partial rollout) or drained them
                paused=total("fully_async/rollouter/paused_at_sync"),
                drained=total("fully_async/rollouter/drained_at_sync"),
                sync_wait_s=total("fully_async/rollouter/sync_wait_s"), partial_ratio=mean(
                    "fully_async/partial/partial_ratio"),
                # where the trainer's step goes: the actor update, and handing the weights to the rollout pool
                update_s=mean("timing_s/update_actor"), export_s=mean("timing_s/sync_rollout_weights"))


def report(args, results: dict) -> None:
    pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"  # noqa: E731
    base = results.get("sync", {}).get("samples_per_s")
    print(f"\n=== {args.shape}, {args.gpus} x {args.device_name}: {args.prompts} prompts x n={args.n} per step, "
          f"responses <= {args.max_response} (mean aimed at {args.mean_response:.0f}), {args.steps} steps ===")
    print("| mode | GPUs (train + rollout) | steps | samples/s | vs sync | step s | response mean / max | "
          "gen share | trainer idle | rollout pool idle | idle decode slots | chunks in flight | "
          "syncs paused / drained (offer -> install s) | responses spanning a sync | update s | weight export s |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    secs = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for mode, r in results.items():
        gpus = f"{args.gpus} colocated" if mode == "sync" else f"{args.gpus // 2} + {args.gpus - args.gpus // 2}"
        vs = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
        flight = "-" if r["depth"] is None else f"{r['in_flight']:.0f} of {r['depth']:.0f}"
        syncs = "-" if r["depth"] is None else (f"{r['paused']:.0f} / {r['drained']:.0f} "
                                                f"({r['sync_wait_s']:.1f})")
        gen = pct(r["gen_share"]) if mode == "sync" else "-"
        print(f"| {mode} | {gpus} | {r['steps']} | {r['samples_per_s']:.2f} | {vs} | {r['step_s']:.1f} | "
              f"{r['response_mean'] or 0:.0f} / {r['response_max']:.0f} | {gen} | "
              f"{pct(r['trainer_idle'])} | {pct(r['rollout_idle'])} | {pct(r['slot_idle'])} | "
              f"{flight} | {syncs} | {pct(r['partial_ratio'])} | {secs(r.get('update_s'))} | "
              f"{secs(r.get('export_s'))} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test of this script)")
    p.add_argument("--shape", default="0p8b", choices=["0p8b", "2b"])
    p.add_argument("--modes", default="sync,one_step,fully_async")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=500)
    p.add_argument("--max-prompt", type=int, default=640)
    p.add_argument("--max-response", type=int, default=8192)
    p.add_argument("--mean-response", type=float, default=1500.0)
    p.add_argument("--chunk-prompts", type=int, default=0, help="fully_async: prompts per generated chunk "
                   "(data.gen_batch_size; default: a quarter of a step's --prompts, several chunks in flight)")
    p.add_argument("--concurrent-samples", type=int, default=0, help="fully_async: prompts in flight per rollout "
                   "replica (async_training.concurrent_samples_per_replica; default: two steps' prompts over the "
                   "rollout replicas, i.e. up to two chunks of a whole step in flight)")
    p.add_argument("--eos-samples", type=int, default=16, help="responses sampled to fit the EOS row to "
                   "--mean-response (gpu_scale.refine_eos_on_samples; 0: the random-id probe only)")
    p.add_argument("--staleness", type=float, default=0.5, help="async_training.staleness_threshold (fully_async)")
    p.add_argument("--partial-rollout", action="store_true", help="fully_async: async_training.partial_rollout=true "
                   "(a weight sync pauses the responses in flight and continues them with the new weights)")
    p.add_argument("--rollout-name", default="hf", choices=["hf", "vllm"],
                   help="the rollout engine of every mode (vllm: the rollout pool's engine keeps the chunks in "
                        "flight with its own continuous batching; partial rollout aborts and resubmits)")
    p.add_argument("--workdir", default="/tmp/verl_async")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--reuse", default="", help="modes not launched again: their metrics files from an earlier "
                   "invocation with the same --workdir join the table (the device tool's calls last at most 10 min)")
    p.add_argument("--build-only", action="store_true", help="build the checkpoint and data, launch nothing")
    p.add_argument("extra", nargs="*", help="more overrides for every launch (key=value)")
    args = p.parse_args(argv)
    if args.gpus < 2:
        p.error("--gpus must be at least 2 (the asynchronous modes need a trainer pool and a rollout pool)")
    if args.tiny:
        args.shape, args.prompts, args.n, args.prompt_chars, args.max_prompt = "tiny_dense", 4, 2, 40, 128
        args.max_response, args.mean_response, args.steps = 32, 12.0, min(args.steps, 3)
    import gpu_scale
    from gpu_grpo_step import build_data

    if not args.tiny:  # the real 0.8B / 2B layer shapes, dense (gpu_scale builds with the EOS calibration)
        from gpu_grpo_step import SHAPES

        kw = {k: v for k, v in SHAPES[args.shape].items() if k != "num_hidden_layers"}
        gpu_scale.SHAPES.setdefault(args.shape, dict(kind="dense", layers=SHAPES[args.shape]["num_hidden_layers"],
                                                     kw=kw))
    import torch

    args.device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    work = Path(args.workdir) / args.shape
    model = work / "model"
    if not (model / "scale_info.json").exists():
        gpu_scale.build_checkpoint(model, args.shape, None, args.device, args.mean_response, args.max_response,
                                   args.eos_samples)
    data = work / "data" / "train.parquet"
    if not data.exists():
        build_data(data, n_rows=args.prompts * (args.steps + 2), filler_chars=args.prompt_chars)
    if args.build_only:
        print(f"[async] built {model} and {data}", flush=True)
        return 0
    results, failed = {}, []
    for mode in [m for m in args.reuse.split(",") if m]:
        log = work / f"{mode}.jsonl"
        records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
        steps = [r for r in records if "timing_s/step" in r["data"]]
        if len(steps) < args.steps:
            failed.append(f"{mode} (reused {log}: {len(steps)} of {args.steps} steps)")
        if steps:
            results[mode] = summarize(steps, args.prompts, args.n)
    for mode in [m for m in args.modes.split(",") if m]:
        rc, steps = launch(args, mode, model, data, work)
        if rc or len(steps) < args.steps:
            failed.append(f"{mode} (exit {rc}, {len(steps)} of {args.steps} steps)")
        if steps:
            results[mode] = summarize(steps, args.prompts, args.n)
    report(args, results)
    out = os.environ.get("OUT")  # the device machine's folder that comes back: every step's metrics, not just the table
    if out:
        import shutil

        for mode in results:
            if (work / f"{mode}.jsonl").exists():
                shutil.copy(work / f"{mode}.jsonl", Path(out) / f"async_{args.shape}_{mode}.jsonl")
    print(f"[async] {'FAILED: ' + ', '.join(failed) if failed else 'OK'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
