"""Actor training throughput (useful tokens/s) and training-step MFU for Qwen3.5: packed vs stock padded.

One actor micro-step = forward + backward of the PPO clipped policy loss (token-mean over response tokens,
entropy also computed) over a GRPO-like batch: 16 sequences, prompts uniform 100-500 tokens, responses
log-normal (median 700, sigma 0.9) clipped to 50-4000, fixed seed (18,662 real tokens, longest 2,446).
The optimizer step is not included. The same model instance and weights serve every row:

  stock         : unpatched ``transformers`` Qwen3_5ForCausalLM on the right-padded batch (B, L_max) with a
                  2D attention mask (with fla installed, transformers runs fla's chunked delta rule on the
                  padded rows), materialised logits -> fp32 -> log-prob of the labels (+ entropy, no grad);
                  ``--stock-micro`` sequences per forward (gradient accumulation), every micro-batch padded
                  to the batch's L_max, so the padded work is that of one (16, L_max) batch.
  megatron      : the Megatron-Core engine (``strategy=megatron``, TP 1) on the same weights (saved once with
                  ``save_pretrained`` and loaded through its weight converter): the batch packed into one THD row,
                  full activation recompute (``recompute_granularity=full``, like gradient checkpointing),
                  log-probs + entropy from the chunked vocab-parallel LM head, bf16 weights with fp32 gradient
                  buffers; one ``forward_backward_batch`` through megatron-core's schedule (no optimizer step).
                  Needs megatron-core; not in the default ``--impls``.
  packed_<be>   : this project's path: ``apply_monkey_patch(use_remove_padding=True, use_fused_kernels=True,
                  fused_kernels_backend=<be>)``, the batch packed by ``verl.workers.engine.fsdp.packing
                  .pack_micro_batch`` into one (1, 18662) row with position ids restarting per sequence
                  (fla varlen GDN, block-diagonal attention), log-probs / entropy fused with the LM head.

Both sides use gradient checkpointing (``use_reentrant=False``) and bf16 parameters (no fp32 master copy).
Useful tokens/s = real (non-pad) tokens / median step time (CUDA events, after warm-up). MFU: model FLOPs of
the real tokens (``verl.utils.flops_counter.count_flops``: 3 x forward, both layer types, causal attention,
chunked delta rule; recomputation from checkpointing not counted) per second, over the bf16 matmul ceiling
measured in the same run (median of 100 timed 8192^3 ``torch.mm`` after the clocks ramp, see
``common.matmul_ceiling``) and over the datasheet dense bf16 peak of the card, identified by name
(``verl.utils.flops_counter.get_device_flops``: H100 SXM / H200 989, H100 NVL 835, H100 PCIe 756 TFLOP/s).

    python benchmarks/bench_actor_throughput.py            # CUDA: Qwen3.5-2B shape, bf16
    python benchmarks/bench_actor_throughput.py --smoke    # tiny shapes; runs on CPU (torch backend only)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[actor +{time.time() - _T0:5.1f}s] {msg}", flush=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    dense_twin_config, fmt_table, grpo_length_mix, matmul_ceiling, median, sync, time_fn)

SHAPE_2B = dict(
    hidden_size=2048,
    num_hidden_layers=24,
    intermediate_size=6144,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
SHAPE_SMOKE = dict(num_hidden_layers=4, vocab_size=4096)


# Qwen3.5-9B's shape (Qwen3_5TextConfig's defaults): the FSDP2 case of issue 20 (`scripts/gpu_scale.py fsdp`)
SHAPE_9B = dict(SHAPE_2B, hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
                num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False)
DENSE_SHAPES = {"2b": SHAPE_2B, "9b": SHAPE_9B}
SHAPES = ("2b", "9b", "35b-a3b", "35b-a3b-dense")


def shape_config(name: str, smoke: bool, layers: int | None):
    """The Hugging Face text config of a benchmark shape.

    ``2b`` / ``9b``: the Qwen3.5-2B / -9B shapes above (``layers`` of their 24 / 32).
    ``35b-a3b``: ``Qwen3_5MoeTextConfig``'s defaults (the 35B-A3B shape:
    hidden 2048, 256 experts top-8, expert FFN 512, shared expert 512) with ``layers`` of its 40 layers (default 4).
    ``35b-a3b-dense``: its dense twin with the same active parameters per token (``common.dense_twin_config``),
    the baseline of issue 20's goal (MoE update within 1.5x the dense model's time per token). ``smoke`` shrinks
    every shape (8 experts top-2 for the MoE)."""
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {SHAPES}")
    if name in DENSE_SHAPES:
        base = SHAPE_SMOKE if smoke else DENSE_SHAPES[name]
        kw = tiny_text_config_kwargs(**dict(base, num_hidden_layers=layers or base["num_hidden_layers"]))
        cfg = tf.Qwen3_5TextConfig(**kw)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        return cfg
    n = layers or 4
    tiny = tiny_text_config_kwargs(**dict(SHAPE_SMOKE, num_hidden_layers=n))
    if smoke:
        moe_kw = dict(tiny, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, tie_word_embeddings=False)
    else:  # the class defaults are the real shape; the tiny tokenizer's special ids and the layer pattern
        moe_kw = dict(num_hidden_layers=n, layer_types=tiny["layer_types"], pad_token_id=tiny["pad_token_id"],
                      eos_token_id=tiny["eos_token_id"], bos_token_id=None)
    moe = tf.Qwen3_5MoeTextConfig(**moe_kw)
    if name == "35b-a3b":
        moe.architectures = ["Qwen3_5MoeForCausalLM"]
        return moe
    return dense_twin_config(moe)


def build_model(cfg, device: torch.device, dtype: torch.dtype):
    import transformers as tf

    cfg.use_cache = False
    cls = tf.Qwen3_5MoeForCausalLM if cfg.architectures[0] == "Qwen3_5MoeForCausalLM" else tf.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    model = model.to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def make_batch(prompts, responses, vocab: int, device, seed: int = 0) -> dict:
    """Right-padded (B, L_max) batch plus per-token RL tensors aligned to 'position t predicts token t+1'."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [p + r for p, r in zip(prompts, responses)]
    b, lmax = len(lengths), max(lengths)
    input_ids = torch.randint(0, vocab, (b, lmax), generator=gen)
    attention_mask = torch.zeros(b, lmax, dtype=torch.long)
    loss_mask = torch.zeros(b, lmax)  # 1 at positions whose *next* token is a response token
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        attention_mask[i, :n] = 1
        loss_mask[i, p - 1 : n - 1] = 1
    input_ids = input_ids * attention_mask  # pad id 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    old_log_probs = -torch.rand(b, lmax, generator=gen) * 12  # plausible log-probs of random tokens
    advantages = torch.randn(b, 1, generator=gen).expand(b, lmax).contiguous()  # one advantage per sequence
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 loss_mask=loss_mask, old_log_probs=old_log_probs, advantages=advantages)
    return {k: v.to(device) for k, v in batch.items()}


def ppo_loss(log_probs, old_log_probs, advantages, mask, n_tokens: float, clip: float = 0.2):
    """Clipped PPO surrogate, summed over masked tokens and divided by the batch's response-token count."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-20, 20))
    surr = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    return (surr * mask).sum() / n_tokens


class StockStep:
    def __init__(self, model, batch, micro: int):
        self.model, self.batch, self.micro = model, batch, micro
        self.n_tokens = float(batch["loss_mask"].sum())
        self.last_log_probs = None

    def __call__(self):
        self.model.zero_grad(set_to_none=True)
        b = self.batch["input_ids"].shape[0]
        kept = []
        for s in range(0, b, self.micro):
            mb = {k: v[s : s + self.micro] for k, v in self.batch.items()}
            logits = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                position_ids=mb["position_ids"], use_cache=False).logits
            logits = logits.float()
            labels = torch.roll(mb["input_ids"], shifts=-1, dims=-1)
            from verl.utils import torch_functional as verl_F

            log_probs = verl_F.logprobs_from_logits(logits, labels)
            with torch.no_grad():
                verl_F.entropy_from_logits(logits)
            loss = ppo_loss(log_probs, mb["old_log_probs"], mb["advantages"], mb["loss_mask"], self.n_tokens)
            loss.backward()
            kept.append(log_probs.detach())
            del logits, log_probs, loss
        self.last_log_probs = torch.cat(kept, 0)


class PackedStep:
    def __init__(self, model, batch):
        from verl.workers.engine.fsdp.packing import pack_micro_batch

        self.model, self.batch = model, batch
        self.pack = pack_micro_batch
        self.n_tokens = float(batch["loss_mask"].sum())
        self.last_log_probs = None

    def __call__(self):
        self.model.zero_grad(set_to_none=True)
        packed = self.pack(self.batch)
        idx = packed.indices
        flat = lambda k: self.batch[k].reshape(-1)[idx].unsqueeze(0)  # noqa: E731
        out = self.model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                         use_cache=False, temperature=1.0, return_dict=True)
        loss = ppo_loss(out.log_probs, flat("old_log_probs"), flat("advantages"), flat("loss_mask"), self.n_tokens)
        loss.backward()
        full = torch.zeros_like(self.batch["old_log_probs"]).reshape(-1)
        self.last_log_probs = full.index_put((idx,), out.log_probs.detach().reshape(-1).float()).view_as(
            self.batch["old_log_probs"])


class MegatronStep:
    """One ``forward_backward_batch`` of the Megatron engine over the whole batch (one packed micro-batch)."""

    def __init__(self, model_dir: str, batch: dict, optimizer_offload: bool = True):
        import torch.distributed as dist
        from omegaconf import OmegaConf

        from verl.protocol import DataProto
        from verl.workers.engine.megatron import MegatronEngine

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29541")
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
        engine_cfg = OmegaConf.create({
            "use_remove_padding": True, "dtype": "bfloat16", "optimizer_offload": optimizer_offload,
            "override_transformer_config": {
                "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}})
        self.engine = MegatronEngine(OmegaConf.create({"path": model_dir}), engine_cfg,
                                     OmegaConf.create({"lr": 1e-6, "total_training_steps": 1}), role="actor")
        self.engine.initialize()
        self.state_gib = self._state_on_device()
        self.n_tokens = float(batch["loss_mask"].sum())
        cpu = {k: v.cpu() for k, v in batch.items()}
        self.data = DataProto.from_dict(tensors=cpu, meta_info={"temperature": 1.0, "micro_batch_size": len(cpu["input_ids"])})
        self.device = batch["input_ids"].device
        self.last_log_probs = None

    def _state_on_device(self) -> dict:
        """GiB of the engine's parameters and gradient buffers on the device (megatron-core keeps one fp32
        ``main_grad`` buffer per parameter); the rest of the resident memory is the optimizer's state."""
        params = [p for chunk in self.engine.model for p in chunk.parameters()]
        on = lambda t: t is not None and t.device.type == "cuda"  # noqa: E731
        gib = 2**30
        return {"params": sum(p.numel() * p.element_size() for p in params if on(p)) / gib,
                "main_grad buffers": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params
                                         if on(getattr(p, "main_grad", None))) / gib}

    def loss(self, outputs: dict, mb: dict):
        return ppo_loss(outputs["log_probs"], mb["old_log_probs"], mb["advantages"], mb["loss_mask"], self.n_tokens), {}

    def __call__(self):
        with self.engine.train_mode():
            self.engine.optimizer_zero_grad()
            out = self.engine.forward_backward_batch(self.data, self.loss, outputs=("log_probs", "entropy"))
        self.last_log_probs = out["outputs"]["log_probs"].to(self.device)


def run(args) -> dict:
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.flops_counter import count_flops, get_device_flops

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.smoke:
        prompts, responses = grpo_length_mix(args.n_seqs, args.seed, (5, 20), 20.0, 0.9, (4, 60))
        dtype = torch.float32 if not cuda else torch.bfloat16
    else:
        prompts, responses = grpo_length_mix(args.n_seqs, args.seed, response_sigma=args.sigma)
        dtype = torch.bfloat16
    lengths = [p + r for p, r in zip(prompts, responses)]
    useful, lmax = sum(lengths), max(lengths)
    pad_frac = 1 - useful / (len(lengths) * lmax)
    log(f"device={device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), dtype={dtype}, "
          f"{len(lengths)} seqs, {useful} real tokens, L_max={lmax}, padded tokens={len(lengths) * lmax}, "
          f"pad fraction={pad_frac:.3f}")

    ceiling = ceiling_info = None
    if not args.no_ceiling:
        measured = (matmul_ceiling(device, n=args.ceiling_n, samples=args.ceiling_samples) if cuda
                    else matmul_ceiling(device, n=256, samples=5, min_warmup_s=0.1, max_warmup_s=1.0))
        ceiling, ceiling_info = measured.median_tflops, measured.describe()
        log(f"measured matmul ceiling: {ceiling_info}")
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    datasheet = get_device_flops("T", device_name)
    log(f"datasheet dense bf16 peak for {device_name!r}: {datasheet:.0f} TFLOP/s"
        + (f"; the measured ceiling is {100 * ceiling / datasheet:.1f}% of it" if ceiling and math.isfinite(datasheet)
           else ""))

    shapes = args.shapes.split(",")
    impls = args.impls.split(",")
    if not cuda:
        impls = [i for i in impls if not i.startswith("packed_triton")]
    results, shape_info, profiles = {}, {}, {}

    def _summary():
        return dict(device=str(device), device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
                    n_seqs=len(lengths), useful_tokens=useful, l_max=lmax, pad_fraction=pad_frac,
                    shapes=dict(shape_info), ceiling_tflops=ceiling, ceiling_info=ceiling_info,
                    datasheet_tflops=datasheet, results=dict(results), profiles=dict(profiles))

    for shape in shapes:
        cfg = shape_config(shape, args.smoke, args.layers)
        model = build_model(cfg, device, dtype)
        n_params = sum(p.numel() for p in model.parameters())
        megatron_dir = None
        if "megatron" in impls:  # the same weights for the Megatron engine, saved before any patching
            import tempfile

            megatron_dir = tempfile.mkdtemp(prefix="bench_megatron_")
            model.save_pretrained(megatron_dir)
        log(f"{shape}: {n_params / 1e9:.3f} B params, {cfg.num_hidden_layers} layers, gradient checkpointing on")
        batch = make_batch(prompts, responses, cfg.vocab_size, device)
        shape_info[shape] = dict(params=n_params, layers=cfg.num_hidden_layers,
                                 train_flops_useful=count_flops(cfg, lengths),
                                 train_flops_padded=count_flops(cfg, [lmax] * len(lengths)))
        ref_lp = None
        mask = batch["loss_mask"].bool()
        for impl in impls:
            key = impl if len(shapes) == 1 else f"{shape}:{impl}"
            lp, ref_lp = run_impl(args, impl, key, model, batch, megatron_dir, device, shape_info[shape], ceiling,
                                  datasheet, useful, results, profiles, apply_monkey_patch, ref_lp)
            if lp is not None and ref_lp is not lp:
                results[key]["lp_mean_abs_diff"] = float((lp[mask] - ref_lp[mask]).abs().mean())
            print_tables(_summary(), partial=True)
        del model, batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    summary = _summary()
    print_tables(summary)
    return summary


def run_impl(args, impl, key, model, batch, megatron_dir, device, info, ceiling, datasheet, useful, results,
             profiles, apply_monkey_patch, ref_lp):
    """Times one row (and profiles it with ``--profile``); returns (its log-probs, the shape's first row's)."""
    cuda = device.type == "cuda"
    if impl == "stock":
        step = StockStep(model, batch, args.stock_micro)
    elif impl.startswith("packed_"):
        # packed_<backend>[@<attention>]: @sdpa / @torch_varlen / @flash_attn pins the packed-attention
        # kernel (VERL_PACKED_ATTN_BACKEND) for this row; without it the default choice applies.
        name, _, attn = impl.partition("@")
        os.environ["VERL_PACKED_ATTN_BACKEND"] = attn or "auto"
        apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                           fused_kernels_backend=name.split("_", 1)[1])
        step = PackedStep(model, batch)
    elif impl == "megatron":
        # The Hugging Face copy leaves the device while the engine runs, so the row's memory is the engine's own.
        model.to("cpu")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        step = MegatronStep(megatron_dir, batch, optimizer_offload=not args.megatron_optimizer_on_gpu)
    else:
        raise ValueError(f"unknown impl {impl!r}")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated(device) / 2**30 if cuda else float("nan")
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for w in range(args.warmup):
            t0 = time.time()
            step()
            sync(device)
            log(f"{key}: warm-up {w + 1} took {time.time() - t0:.1f}s")
        times = time_fn(step, device, 0, args.repeat)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    except torch.OutOfMemoryError as e:  # report and go on with the other rows
        log(f"{key}: OOM ({str(e).splitlines()[0]})")
        results[key] = {"oom": True}
        model.zero_grad(set_to_none=True)
        return None, ref_lp
    t = median(times)
    lp = step.last_log_probs
    achieved = info["train_flops_useful"] / t / 1e12
    results[key] = dict(step_s=t, times=times, tok_s=useful / t, tflops=achieved, peak_gib=peak, resident_gib=resident,
                        mfu_ceiling=achieved / ceiling if ceiling else float("nan"),
                        mfu_datasheet=achieved / datasheet if math.isfinite(datasheet) else float("nan"),
                        padded_tflops=(info["train_flops_padded"] / t / 1e12) if impl == "stock" else None,
                        lp_mean_abs_diff=float("nan"), state=getattr(step, "state_gib", None))
    log(f"{key}: median {t * 1e3:.1f} ms over {len(times)} (all: "
        + ", ".join(f"{x * 1e3:.0f}" for x in times) + f"), {useful / t:,.0f} useful tok/s, resident "
        f"{resident:.1f} GiB, peak {peak:.1f} GiB")
    if args.profile:
        from step_profile import memory_at_peak, profile_kernels

        prof = profile_kernels(step, device, args.profile, key.replace(":", "_"), top=args.profile_top)
        mem = memory_at_peak(step, device)
        profiles[key] = dict(kernels=prof["summary"], classes=prof["classes"], trace=prof["trace"],
                             memory={k: v for k, v in mem.items() if k != "table"})
        print("\n" + prof["class_table"] + "\n\n" + prof["table"] + "\n\n#### " + key
              + ": memory at the step's peak\n\n" + mem["table"] + "\n", flush=True)
    if impl == "megatron":
        del step
        gc.collect()
        model.to(device)
    else:
        model.zero_grad(set_to_none=True)
    return lp, (lp if ref_lp is None else ref_lp)


def print_tables(s: dict, partial: bool = False) -> None:
    res = s["results"]
    rows = []
    for key, r in res.items():
        shape = key.split(":")[0] if ":" in key else next(iter(s["shapes"]), "")
        stock = res.get(f"{shape}:stock" if ":" in key else "stock", {})
        base = stock.get("tok_s")
        if r.get("oom"):
            rows.append([key, "OOM"] + ["-"] * 9)
            continue
        ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
        rows.append([key, f"{r['step_s'] * 1e3:.0f}", f"{r['tok_s']:,.0f}", ratio, f"{r['tflops']:.1f}",
                     f"{100 * r['mfu_ceiling']:.1f}%", f"{100 * r['mfu_datasheet']:.1f}%", f"{r['resident_gib']:.1f}",
                     f"{r['peak_gib']:.1f}", f"{r['peak_gib'] - r['resident_gib']:.1f}",
                     f"{r['lp_mean_abs_diff']:.3g}"])
    shapes = ", ".join(f"{k} ({v['params'] / 1e9:.2f} B, {v['layers']} layers)" for k, v in s["shapes"].items())
    print(f"\n=== {'(partial) ' if partial else ''}(a) actor throughput, Qwen3.5 {shapes}, {s['device_name']}: "
          f"{s['n_seqs']} seqs, {s['useful_tokens']:,} useful tokens, L_max {s['l_max']}, "
          f"pad fraction {s['pad_fraction']:.3f} (stock pads to {s['n_seqs'] * s['l_max']:,}) ===")
    print("fwd+bwd of the PPO policy loss, gradient checkpointing on every row, bf16 params; resident = allocated "
          "before the first step (weights, gradient buffers, optimizer state on the device), step = peak - resident")
    print(fmt_table(["impl", "step ms", "useful tok/s", "vs stock", "useful TFLOP/s", "MFU (meas. ceiling)",
                     "MFU (datasheet)", "resident GiB", "peak GiB", "step GiB", "mean abs dlogp vs first row"], rows))
    for key, r in res.items():
        if r.get("state"):
            print(f"{key} state on the device: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in r["state"].items()))
    moe_dense = [(k, k.replace("35b-a3b:", "35b-a3b-dense:")) for k in res if k.startswith("35b-a3b:")]
    for moe, dense in moe_dense:
        if dense in res and not res[moe].get("oom") and not res[dense].get("oom"):
            print(f"time per token, {moe} / {dense} (same active parameters): "
                  f"{res[dense]['tok_s'] / res[moe]['tok_s']:.2f}x (issue 20's goal: <= 1.5x)")
    ceiling = s["ceiling_tflops"]
    for shape, v in s["shapes"].items():
        print(f"=== (c) {shape}: {v['train_flops_useful'] / 1e12:.1f} TFLOP per step on useful tokens (3 x fwd, GDN + "
              "full-attention layers, LM head)" + (f", measured matmul ceiling {s['ceiling_info']}, datasheet "
                                                  f"{s['datasheet_tflops']:.0f} TFLOP/s ({s['device_name']})"
                                                  if ceiling else ""))
        stock = res.get("stock" if len(s["shapes"]) == 1 else f"{shape}:stock", {})
        if ceiling and stock and not stock.get("oom") and stock.get("padded_tflops"):
            print(f"stock, counting the pad tokens it computes ({v['train_flops_padded'] / 1e12:.1f} TFLOP): "
                  f"{stock['padded_tflops']:.1f} TFLOP/s = {100 * stock['padded_tflops'] / ceiling:.1f}% of the "
                  "ceiling")
    print(flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths (CPU ok)")
    p.add_argument("--device", default=None)
    p.add_argument("--impls", default="stock,packed_triton,packed_torch")
    p.add_argument("--n-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma of response lengths")
    p.add_argument("--stock-micro", type=int, default=4, help="sequences per stock forward (grad accumulation)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul ceiling measurement")
    p.add_argument("--ceiling-n", type=int, default=8192, help="matmul size of the ceiling (CUDA)")
    p.add_argument("--ceiling-samples", type=int, default=100, help="timed matmuls whose median is the ceiling")
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument("--shapes", default="2b", help=f"comma-separated, of {SHAPES}")
    p.add_argument("--layers", type=int, default=None, help="layer count (35b-a3b shapes: default 4; 2b / 9b: all)")
    p.add_argument("--megatron-optimizer-on-gpu", action="store_true",
                   help="keep the Megatron optimizer's fp32 state on the device (default: offloaded, as the "
                        "packed rows hold no optimizer state)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing each row: one profiled step (Chrome trace into DIR, top kernels and kernel "
                        "classes printed) and one step under the allocator's history (what is alive at the peak)")
    p.add_argument("--profile-top", type=int, default=20)
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.repeat = min(args.warmup, 1), min(args.repeat, 2)
    summary = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
