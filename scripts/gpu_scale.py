"""Real-size Qwen3.5 GRPO on one host of several GPUs (issue 20): 9B dense on FSDP2, 35B-A3B MoE on Megatron.

Every run goes through ``python -m verl.trainer.main_ppo`` with the Ray launcher and the built-in (``hf``)
rollout, on a randomly initialised checkpoint with the real Hugging Face configs' layer shapes:

* ``9b``: Qwen3_5TextConfig's defaults, the 9B shape (hidden 4096, 32 layers L,L,L,F, FFN 12288, 16 q / 4 kv
  heads x 256, Gated DeltaNet 16 k / 32 v heads x 128, vocab 248,320, untied);
* ``35b_a3b``: Qwen3_5MoeTextConfig's defaults, the 35B-A3B shape (hidden 2048, 256 experts top-8, expert FFN
  512, shared expert 512, vocab 248,320), with ``--layers`` of its 40 layers (what fits is stated in the run);
* ``35b_a3b_dense`` (``megatron --dense-twin``): its dense twin with the same active parameters per token
  (``benchmarks/common.dense_twin_config``), data parallel: the baseline of the MoE update's time per token
  (the table's ``update us/token``).

A random model almost never samples its EOS token (1 in 248k), so every response would run to the limit. To
get a long-tailed length mix instead, the checkpoint's EOS row of the LM head is set to ``alpha * e_k`` (``k``
the hidden dimension that varies most over positions) with ``alpha`` solved so that the mean EOS probability
per position, measured on random token sequences, is ``1 / --mean-response``: lengths then come out roughly
geometric with that mean, clipped at ``--max-response``. What was really generated is printed per step
(``response_length/mean`` / ``max``); the model is otherwise untouched.

Each case runs twice: steps 1..S-1 with a checkpoint saved after the last of them, then a resumed run
(``resume_mode=auto``) that loads it and trains step S (``--steps S``, default 4: steps 1-3, then step 4). The table per step: seconds per phase (gen, old log-prob, ref, update, weight
sync, save), tokens/s per GPU, MFU of the actor update against the datasheet (``perf/mfu/actor``) and against
a bf16 matmul ceiling measured first in the same run, peak memory per GPU, and the generation share.

    python scripts/gpu_scale.py fsdp --gpus 4                       # 9B on FSDP2
    python scripts/gpu_scale.py megatron --gpus 4 --ep 4            # 35B-A3B on Megatron, EP=4
    python scripts/gpu_scale.py megatron --gpus 4 --tp 2 --ep 2     # TP=2 x EP=2
    python scripts/gpu_scale.py megatron --gpus 4 --dense-twin      # its dense twin, data parallel
    python scripts/gpu_scale.py fsdp --tiny --device cpu --gpus 1   # the same path, tiny shapes, CPU (smoke)
    python scripts/gpu_scale.py check                               # compose + validate every command (CPU)

``--stage build|train|resume`` runs one stage (the device tool's calls last at most 10 minutes; the checkpoint,
metrics and wall times stay in ``--workdir`` for the next stage, which prints the table so far).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))  # common.dense_twin_config: one definition of the MoE's dense twin

SHAPES = {  # overrides of the Hugging Face config class's defaults (which are the real shapes)
    "9b": dict(kind="dense", layers=32, kw={}),
    "35b_a3b": dict(kind="moe", layers=40, kw={}),
    "tiny_dense": dict(kind="dense", layers=4, kw=dict(vocab_size=2048)),
    "tiny_moe": dict(kind="moe", layers=4, kw=dict(vocab_size=2048, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # the MoE shapes' dense twins (--dense-twin): the same active parameters per token
    "35b_a3b_dense": dict(kind="dense", layers=40, twin_of="35b_a3b"),
    "tiny_moe_dense": dict(kind="dense", layers=4, twin_of="tiny_moe"),
}
PHASES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint", "step"]


def _config(shape: str, layers: int | None):
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    spec = SHAPES[shape]
    if "twin_of" in spec:
        from common import dense_twin_config

        return dense_twin_config(_config(spec["twin_of"], layers))
    cls = tf.Qwen3_5TextConfig if spec["kind"] == "dense" else tf.Qwen3_5MoeTextConfig
    n = layers or spec["layers"]
    if shape.startswith("tiny"):
        kw = tiny_text_config_kwargs(num_hidden_layers=n, tie_word_embeddings=False, **spec["kw"])
    else:
        # the real shape: the class defaults, with the tiny tokenizer's special ids and the layer count
        tiny = tiny_text_config_kwargs(num_hidden_layers=n)
        kw = dict(num_hidden_layers=n, layer_types=tiny["layer_types"], pad_token_id=tiny["pad_token_id"],
                  eos_token_id=tiny["eos_token_id"], bos_token_id=None, **spec["kw"])
    cfg = cls(**kw)
    cfg.architectures = ["Qwen3_5ForCausalLM" if spec["kind"] == "dense" else "Qwen3_5MoeForCausalLM"]
    return cfg


def calibrate_eos(model, eos_id: int, mean_len: float, device: str, seq_len: int = 256) -> tuple[float, int]:
    """Set the LM head's EOS row to ``alpha * e_k`` so the mean EOS probability over random sequences is
    ``1 / mean_len``; returns ``(alpha, k)``."""
    import torch

    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq_len), generator=g).to(device)
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state.float().reshape(-1, model.config.hidden_size)
        w = model.lm_head.weight
        w[eos_id].zero_()
        others = torch.cat([(h @ w[:eos_id].float().T), (h @ w[eos_id + 1:].float().T)], dim=-1)
        lse = torch.logsumexp(others, dim=-1)
        k = int(h.var(dim=0).argmax())
        x = h[:, k]

        def mean_p(alpha: float) -> float:
            z = alpha * x
            return torch.exp(z - torch.logaddexp(lse, z)).mean().item()

        lo, hi, target = 0.0, 1.0, 1.0 / mean_len
        while mean_p(hi) < target and hi < 1e6:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_p(mid) < target else (lo, mid)
        w[eos_id, k] = hi
    return hi, k


def refine_eos_on_samples(model, eos_id: int, k: int, mean_len: float, max_len: int, device: str,
                          samples: int = 16, tokens: int = 256, prompt_len: int = 64,
                          seed: int = 2, prompts=None) -> tuple[float, float]:
    """Re-fit the EOS row's ``alpha`` (the row stays ``alpha * e_k``) on the model's own sampled responses, so the
    expected response length, capped at ``max_len``, is ``mean_len``; returns ``(alpha, expected length under the
    probe's alpha)``.

    :func:`calibrate_eos` fits the mean stop probability on random token ids. A deep random model's hidden
    states along its own samples are distributed differently (on 2 x H100, 2026-11-26, the 0.8B shape probe-fitted
    to a mean of 1,500 produced 3,165 with a cap of 8,192), so this samples ``samples`` responses of ``tokens``
    tokens at temperature 1 with EOS suppressed -- until a stop, a response does not depend on the EOS row, so one
    set of samples prices every alpha -- and computes the expected length exactly over the sampled positions
    (survival = product of 1 - p(stop)) and geometrically past them (the stop probability of the later half).

    ``prompts`` (a ``(samples, prompt_len)`` id tensor, e.g. :func:`dataset_prompts`): the run's own prompts instead
    of random ids. The hidden states, and so the stop probability, drift with the context: fitted on 64 random ids
    and 256 sampled tokens, the 9B shape aimed at 1,024 generated means of 2,700-3,200 (4 x H100, 2026-11-26) and
    ~450 (4 x H200, 2026-11-27)."""
    import torch

    vocab = model.config.vocab_size
    tokens = min(tokens, max_len)  # positions past the cap do not count
    if prompts is None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        prompts = torch.randint(0, vocab, (samples, prompt_len), generator=g)
    prompts = prompts.to(device)
    samples, prompt_len = prompts.shape
    w = model.lm_head.weight
    probe_alpha = w[eos_id, k].item()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens,
                             suppress_tokens=[eos_id], eos_token_id=eos_id, pad_token_id=eos_id)
        # the state after token j - 1 gives the distribution of response token j
        h = model.model(input_ids=out).last_hidden_state[:, prompt_len - 1:-1].float()
        row = w[eos_id].clone()
        w[eos_id].zero_()
        lse = torch.stack([torch.logsumexp(torch.cat([h[i] @ w[:eos_id].float().T, h[i] @ w[eos_id + 1:].float().T],
                                                     dim=-1), dim=-1) for i in range(samples)])
        w[eos_id] = row
        x = h[..., k]
    n = x.shape[1]
    half = n // 2

    def expected(alpha: float) -> float:
        z = alpha * x
        p = torch.exp(z - torch.logaddexp(lse, z)).double()  # (samples, n): stop probability per position
        surv = torch.cumprod(torch.cat([torch.ones_like(p[:, :1]), 1 - p], dim=1), dim=1)  # surv[:, j] = P(len > j)
        inside = surv[:, :min(n, max_len)].sum(1)
        if max_len > n:
            q = p[:, half:].mean(1).clamp(min=1e-12)
            inside = inside + surv[:, n] * (1 - (1 - q) ** (max_len - n)) / q
        return inside.mean().item()

    before = expected(probe_alpha)
    # scan a geometric grid around the probe's alpha (the length need not be monotone in alpha where x < 0),
    # then bisect inside the bracket closest to the target
    grid = [probe_alpha * 2 ** (i / 4) for i in range(-24, 25)]
    vals = [expected(a) for a in grid]
    best = min(range(len(grid)), key=lambda i: abs(vals[i] - mean_len))
    lo_i = best - 1 if best > 0 and (vals[best - 1] - mean_len) * (vals[best] - mean_len) <= 0 else best
    hi_i = lo_i + 1 if lo_i + 1 < len(grid) else lo_i
    lo, hi = grid[lo_i], grid[hi_i]
    if (expected(lo) - mean_len) * (expected(hi) - mean_len) <= 0:
        for _ in range(40):
            mid = (lo + hi) / 2
            if (expected(lo) - mean_len) * (expected(mid) - mean_len) <= 0:
                hi = mid
            else:
                lo = mid
        alpha = (lo + hi) / 2
    else:
        alpha = grid[best]
    with torch.no_grad():
        w[eos_id, k] = alpha
    return alpha, before


def dataset_prompts(data: Path, tokenizer, samples: int):
    """The first ``samples`` rows' prompts as the RL dataset renders them (chat template, generation prompt), cut
    from the left to the shortest so that they stack: the calibration's context is the run's."""
    import pandas as pd
    import torch

    from verl.utils.chat_template import apply_chat_template

    rows = pd.read_parquet(data)["prompt"].tolist()[:samples]
    ids = [list(apply_chat_template(tokenizer, list(r), tokenize=True)) for r in rows]
    n = min(len(x) for x in ids)
    return torch.tensor([x[len(x) - n:] for x in ids])


def build_checkpoint(path: Path, shape: str, layers: int | None, device: str, mean_len: float,
                     max_len: int | None = None, eos_samples: int = 16, data: Path | None = None) -> dict:
    import torch
    import transformers as tf

    from verl.models.tiny import build_tiny_tokenizer

    cfg = _config(shape, layers)
    cls = tf.Qwen3_5ForCausalLM if SHAPES[shape]["kind"] == "dense" else tf.Qwen3_5MoeForCausalLM
    t0 = time.time()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.set_default_dtype(dtype)  # build in the saved dtype: a 35B fp32 copy would not fit one GPU
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    alpha, k = calibrate_eos(model, cfg.eos_token_id, mean_len, device)
    refit = {}
    if max_len and eos_samples:
        # the run's prompts and as many sampled tokens as the aimed mean: most of the length distribution's mass
        # is then priced on sampled positions, not extrapolated
        prompts = dataset_prompts(data, build_tiny_tokenizer(), eos_samples) if data is not None else None
        tokens = max(256, int(mean_len))
        alpha, probe_len = refine_eos_on_samples(model, cfg.eos_token_id, k, mean_len, max_len, device,
                                                 samples=eos_samples, tokens=tokens, prompts=prompts)
        refit = dict(eos_probe_expected_len=probe_len, eos_fit_prompt_tokens=0 if prompts is None else
                     prompts.shape[1], eos_fit_sampled_tokens=min(tokens, max_len))
    n_params = sum(p.numel() for p in model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    build_tiny_tokenizer(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    info = dict(shape=shape, layers=cfg.num_hidden_layers, params_b=n_params / 1e9, eos_alpha=alpha, eos_dim=k,
                **refit, seconds=time.time() - t0)
    (path / "scale_info.json").write_text(json.dumps(info))
    print(f"[scale] checkpoint {path}: {info}", flush=True)
    return info


def matmul_ceiling_tflops(device: str, n: int = 8192, reps: int = 30) -> float | None:
    """Median bf16 matmul TFLOP/s after the clocks ramp (a warm-up second), on this process's GPU."""
    import torch

    if device != "cuda":
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def _common(args, model_dir: Path, data: Path, ckpt: Path, steps: int, resume: bool) -> list[str]:
    tok = args.max_prompt + args.max_response
    return [
        "trainer.launcher=ray", f"trainer.device={args.device}", "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={args.gpus}", f"trainer.total_training_steps={steps}",
        "trainer.logger=[console,file]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"trainer.save_freq={-1 if args.no_save else args.steps - 1}", f"trainer.default_local_dir={ckpt}",
        f"trainer.resume_mode={'auto' if resume else 'disable'}",
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data}", f"data.val_files={data}",
        f"data.train_batch_size={args.prompts}", f"data.max_prompt_length={args.max_prompt}",
        f"data.max_response_length={args.max_response}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={int(tok * args.update_tokens)}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={tok * 4}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={tok * 4}",
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_mem}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.adv_estimator=grpo",
        *_profile_overrides(args, model_dir.parent / f"prof_{args.tp}x{args.ep}"),
    ]


def _profile_overrides(args, where: Path) -> list[str]:
    """``--profile S``: a torch.profiler trace (host and device) of rank 0's actor worker in step S."""
    if not args.profile:
        return []
    keys = ["global_profiler.tool=torch", f"global_profiler.steps=[{args.profile}]",
            f"global_profiler.save_path={where}",
            "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[0]"]
    if args.profile_tasks:
        # one trace per actor task (old log-prob, update), generation untraced; device events only, so that a
        # step of 64 prompts stays a trace of tens of MB and the profiled step's timings stay close to a clean one
        keys += ["actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true",
                 "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cuda]"]
    return keys


def fsdp_overrides(args, model_dir, data, ckpt, steps, resume) -> list[str]:
    return ["--config-name", "ppo_trainer", *_common(args, model_dir, data, ckpt, steps, resume),
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.model.use_remove_padding=true",
            # log-probs and entropy fused with the LM head: no [tokens, 248k] logits, so larger micro-batches
            # (docs/advance/qwen3_5.md's recommended setting; the 2026-11-26 table ran without it)
            "actor_rollout_ref.model.use_fused_kernels=true",
            # the Triton kernels on CUDA (the actor benchmark's packed_triton row: 1.2x its torch backend's tok/s)
            "actor_rollout_ref.model.fused_kernel_options.impl_backend="
            + ("triton" if args.device == "cuda" else "torch"),
            f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={str(args.offload).lower()}",
            "actor_rollout_ref.ref.fsdp_config.param_offload=true", *args.extra]


def megatron_overrides(args, model_dir, data, ckpt, steps, resume) -> list[str]:
    return ["--config-name", "ppo_megatron_trainer", *_common(args, model_dir, data, ckpt, steps, resume),
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={args.tp}",
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={args.ep}",
            f"actor_rollout_ref.ref.megatron.tensor_model_parallel_size={args.tp}",
            f"actor_rollout_ref.ref.megatron.expert_model_parallel_size={args.ep}",
            "actor_rollout_ref.actor.megatron.use_remove_padding=true",
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
            f"actor_rollout_ref.actor.megatron.optimizer_offload={str(args.offload).lower()}",
            "actor_rollout_ref.ref.megatron.param_offload=true", *args.extra]


def _run(overrides: list[str], log: Path, cwd: Path, timeout: int) -> tuple[int, float, list[dict]]:
    from gpu_multi import _run_main_ppo  # the same launch (file logger, PYTHONPATH, timeout) as the 2-GPU checks

    t0 = time.time()
    rc, steps = _run_main_ppo(overrides, log, cwd, timeout)
    return rc, time.time() - t0, steps


def _assets(args, shape: str) -> tuple[Path, Path, dict]:
    from gpu_grpo_step import build_data

    work = Path(args.workdir) / f"{shape}_{args.layers or 'all'}"
    model_dir = work / "model"
    data = work / "data" / "train.parquet"
    if not data.exists():  # the tiny tokenizer is character-level: filler characters ~ prompt tokens
        build_data(data, n_rows=max(args.prompts * 4, args.eos_samples), filler_chars=args.prompt_chars)
    if not (model_dir / "scale_info.json").exists():
        build_checkpoint(model_dir, shape, args.layers, args.device, args.mean_response, args.max_response,
                         args.eos_samples, data=data)
    info = json.loads((model_dir / "scale_info.json").read_text())
    return model_dir, data, info


def report(steps: list[dict], info: dict, args, ceiling: float | None, walls: tuple[float, float]) -> None:
    from verl.utils.flops_counter import get_device_flops

    keys = [k for k in PHASES if any(f"timing_s/{k}" in r["data"] for r in steps)]
    print(f"\n=== {info['shape']} ({info['layers']} layers, {info['params_b']:.2f} B params), {args.what}, "
          f"{args.gpus} x {args.device_name}: {args.prompts} prompts x n={args.n}, prompts ~{args.prompt_chars} "
          f"tokens, responses <= {args.max_response} (mean aimed at {args.mean_response:.0f}) ===")
    cols = [f"{k} s" for k in keys] + ["resp mean / max", "tok/s/GPU", "MFU datasheet", "MFU measured",
                                       "update us/token", "peak GiB", "gen share"]
    print("| step | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    promised = get_device_flops("T", args.device_name) if args.device == "cuda" else float("inf")
    for r in steps:
        d = r["data"]
        mfu = d.get("perf/mfu/actor")
        cells = [f"{d[f'timing_s/{k}']:.1f}" if f"timing_s/{k}" in d else "-" for k in keys]
        cells += [f"{d.get('response_length/mean', 0):.0f} / {d.get('response_length/max', 0):.0f}",
                  f"{d.get('perf/throughput', 0):,.0f}",
                  f"{100 * mfu:.1f} %" if mfu is not None else "-",
                  f"{100 * mfu * promised / ceiling:.1f} %" if mfu is not None and ceiling else "-",
                  # the update's seconds per prompt + response token (the MoE vs dense-twin comparison)
                  f"{1e3 * d['timing_per_token_ms/update_actor']:.0f}" if "timing_per_token_ms/update_actor" in d
                  else "-",
                  f"{d.get('perf/max_memory_allocated_gb', float('nan')):.1f}",
                  f"{100 * d.get('timing_s/gen', 0) / step_without_save(d):.0f} %"]
        print(f"| {r['step']} | " + " | ".join(cells) + " |")
    engine_table(steps)
    print(f"\nbf16 matmul ceiling measured: {f'{ceiling:.0f} TFLOP/s' if ceiling else 'n/a'}; datasheet "
          f"{promised:.0f} TFLOP/s. First launch (steps 1-{args.steps - 1}{'' if args.no_save else ' + save'}) "
          f"{walls[0]:.0f} s wall" + ("" if args.no_save else f"; resumed launch (load + step {args.steps}) "
                                      f"{walls[1]:.0f} s wall") +
          f". EOS row alpha {info['eos_alpha']:.3g} on dim {info['eos_dim']}.", flush=True)


def step_without_save(d: dict) -> float:
    """The step's seconds without its checkpoint save (``timing_s/step`` includes a save, as upstream's does): the
    generation share's denominator, the same on save steps and others."""
    return d["timing_s/step"] - d.get("timing_s/save_checkpoint", 0.0)


def engine_table(steps: list[dict]) -> None:
    """Where the generation phase went, from the hf decode loop's own figures (``perf/hf_engine/*``, the slowest
    rank's each): its time in all, the CUDA-graph warm-up, the prefills, and per decode step what is left (the
    quantity the memory-bound floor of one step bounds), with the mean live slots per step and the share of the
    decode time the host spent waiting for the device (near 100 %: device-bound; well below: the device idled
    while the host loop ran)."""
    rows = [r for r in steps if "perf/hf_engine/decode_steps" in r["data"]]
    if not rows:
        return
    print("\n| step | gen s | engine s | graph warm-up s | prefill s | decode steps | decode ms/step | slots | "
          "mean live slots | host waited on the device |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = {k.rsplit("/", 1)[-1]: v for k, v in r["data"].items() if k.startswith("perf/hf_engine/")}
        n = d.get("decode_steps", 0)
        run, warm, pre = d.get("run_s", float("nan")), d.get("warmup_s", 0.0), d.get("prefill_s", 0.0)
        decode = run - warm - pre
        per = 1e3 * decode / n if n else float("nan")
        live = d.get("slot_steps", 0) / n if n else float("nan")
        wait = f"{100 * d['device_wait_s'] / decode:.0f} %" if "device_wait_s" in d and decode > 0 else "-"
        print(f"| {r['step']} | {r['data'].get('timing_s/gen', float('nan')):.1f} | {run:.1f} | {warm:.1f} | "
              f"{pre:.1f} | {n:,.0f} | {per:.1f} | {d.get('slots', 0):.0f} | {live:.1f} | {wait} |")


def _steps_of(log: Path) -> list[dict]:
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return [r for r in records if "timing_s/step" in r["data"]]


def run_case(args, shape: str, make) -> int:
    """``--stage all`` = build, train (steps 1-3 + save), resume (step 4); each stage alone fits a device call
    of limited length (the machine's /tmp, where the checkpoint and metrics live, survives between calls)."""
    import torch

    args.device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    model_dir, data, info = _assets(args, shape)
    if args.stage == "build":
        return 0
    work = model_dir.parent
    ckpt = work / f"ckpt_{args.what}_{args.tp}x{args.ep}"
    walls = work / f"walls_{args.what}_{args.tp}x{args.ep}.json"
    seen = json.loads(walls.read_text()) if walls.exists() else {}
    rc = 0
    for stage, steps, resume in (("train", args.steps - 1, False), ("resume", args.steps, True)):
        if args.stage not in ("all", stage):
            continue
        if stage == "train":
            seen["ceiling"] = matmul_ceiling_tflops(args.device)
        rc, wall, _ = _run(make(args, model_dir, data, ckpt, steps, resume), work / f"{stage}_{args.tp}x{args.ep}.jsonl",
                           work, args.timeout)
        seen[stage] = dict(rc=rc, wall=wall)
        walls.write_text(json.dumps(seen))
        if rc:
            break
    steps = (_steps_of(work / f"train_{args.tp}x{args.ep}.jsonl")
             + _steps_of(work / f"resume_{args.tp}x{args.ep}.jsonl"))
    report(steps, info, args, seen.get("ceiling"),
           (seen.get("train", {}).get("wall", 0.0), seen.get("resume", {}).get("wall", 0.0)))
    if args.profile and args.stage != "build":
        import trace_top_kernels

        windows = [] if args.profile_tasks else ["--window", "generate_sequences", "--window", "compute_log_prob",
                                                 "--window", "update_actor"]
        trace_top_kernels.main([str(work / f"prof_{args.tp}x{args.ep}"), "--top", "30", *windows])
    done = [r["step"] for r in steps]
    want = list(range(1, args.steps if args.stage == "train" else args.steps + 1))
    ok = rc == 0 and done == want
    print(f"[scale {args.what}] {'OK' if ok else 'FAILED'} (stage {args.stage}, exit {rc}, steps {done})", flush=True)
    return 0 if ok else 1


def check(args) -> int:
    """Compose and validate both commands at full shape (CPU, no run): they must stay valid as the config moves."""
    from verl.trainer.main_ppo import load_config

    work = Path(args.workdir) / "check"
    for shape in ("tiny_dense", "tiny_moe", "tiny_moe_dense"):
        model_dir = work / shape / "model"
        if not (model_dir / "scale_info.json").exists():
            build_checkpoint(model_dir, shape, None, "cpu", args.mean_response, args.max_response, args.eos_samples)
    data = work / "data.parquet"
    from gpu_grpo_step import build_data

    build_data(data, n_rows=8, filler_chars=50)
    for what, make, shape, ep in (("fsdp", fsdp_overrides, "tiny_dense", 2), ("megatron", megatron_overrides,
                                                                             "tiny_moe", 2),
                                  ("megatron", megatron_overrides, "tiny_moe_dense", 1)):
        a = argparse.Namespace(**{**vars(args), "what": what, "gpus": 4, "tp": 2, "ep": ep, "device": "cuda"})
        for resume in (False, True):
            load_config(make(a, work / shape / "model", data, work / "ckpt", 4, resume))
    print("[scale check] every command composes and validates", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["fsdp", "megatron", "check"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test of this script)")
    p.add_argument("--layers", type=int, default=None, help="layer count (default: the real model's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--offload", action="store_true", help="optimizer offload to the CPU")
    p.add_argument("--dense-twin", action="store_true",
                   help="megatron: the MoE shape's dense twin (same active parameters per token; --ep 1), the "
                        "baseline of the MoE update's time per token")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (train_batch_size)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=1000, help="filler per prompt (~tokens)")
    p.add_argument("--max-prompt", type=int, default=1280)
    p.add_argument("--max-response", type=int, default=4096)
    p.add_argument("--mean-response", type=float, default=1024.0)
    p.add_argument("--eos-samples", type=int, default=16, help="responses sampled to fit the EOS row to "
                   "--mean-response (refine_eos_on_samples; 0: the random-id probe only)")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps in all: the first launch trains all but the "
                   "last and saves, the resumed launch trains the last")
    p.add_argument("--no-save", action="store_true",
                   help="no checkpoint save after the first launch (a layout measured for its steps only)")
    p.add_argument("--update-tokens", type=float, default=2.0,
                   help="actor micro-batch tokens per GPU, in multiples of max prompt + max response")
    p.add_argument("--stage", default="all", choices=["all", "build", "train", "resume"],
                   help="build the checkpoint only, run steps 1..S-1 + save, run the resumed step S, or all three")
    p.add_argument("--workdir", default="/tmp/verl_scale")
    p.add_argument("--profile", type=int, default=0, metavar="STEP",
                   help="trace the actor's calls of this step (torch.profiler, rank 0) and print the top kernels")
    p.add_argument("--profile-tasks", action="store_true",
                   help="with --profile: one device-only trace per actor task (old log-prob, update; upstream's "
                        "tool_config.torch.discrete), generation untraced")
    p.add_argument("--timeout", type=int, default=3000, help="seconds per main_ppo launch")
    p.add_argument("--gpu-mem", type=float, default=0.85,
                   help="rollout.gpu_memory_utilization: the share of the card the decode loop's slots may fill "
                        "(with the weights already there); at upstream's 0.5 a 9B model's 128 slots of 5k tokens "
                        "would be cut to about 70 on an 80 GB card")
    p.add_argument("extra", nargs="*", help="more main_ppo overrides (key=value)")
    args = p.parse_args(argv)
    if args.what == "check":
        return check(args)
    if args.no_save and args.stage in ("all", "resume"):
        p.error("--no-save leaves nothing to resume: --stage build or train")
    if args.tiny:
        args.prompts, args.n, args.prompt_chars, args.max_prompt = 4, 2, 40, 128
        args.max_response, args.mean_response = 32, 12.0
    if args.what == "fsdp":
        return run_case(args, "tiny_dense" if args.tiny else "9b", fsdp_overrides)
    if args.dense_twin and args.ep != 1:
        p.error("--dense-twin has no experts to place: --ep 1 (its data parallelism is --gpus / --tp)")
    shape = "tiny_moe" if args.tiny else "35b_a3b"
    return run_case(args, shape + ("_dense" if args.dense_twin else ""), megatron_overrides)


if __name__ == "__main__":
    sys.exit(main())
