"""Rollout throughput: the ``hf`` engine's own Qwen3.5 decode loop vs Hugging Face ``model.generate`` and vLLM.

Same process, same randomly initialised model (Qwen3.5-0.8B shape, or ``--shape 2b`` for the 2B layer shape; bf16;
the shapes of scripts/gpu_grpo_step.py):

  (1) fixed lengths: B prompts of 256 random tokens, 512 new tokens forced (no stop token), sampling at T=1
      (no top-k / top-p), B = 64 and 256. ``engine`` is ``HFRollout.generate`` (packed prefill, CUDA-graph
      decode, on-device sampling, continuous batching); ``generate`` is ``model.generate(do_sample=True,
      temperature=1, top_k=0, min_new_tokens=512)`` on the left-padded batch. New tokens/s = B * 512 / wall
      time of the whole call (prefill included), after one small warm-up call of each.
  (2) GRPO-like length mix: P prompts (uniform 100-500 tokens) x n samples, response lengths log-normal
      (median 128, sigma 0.9, clipped to 16..512; seeded), imposed as per-sequence token budgets (random
      weights never emit a meaningful EOS), ``max_num_seqs`` slots. Rows: the engine with continuous batching;
      the engine in static batches (a batch is refilled only when all its sequences ended); and ``generate``
      in static batches (each batch runs to its longest member: the cost of one batch is measured on the first
      batch and charged to every batch, to keep the run short). Useful tokens/s = real response tokens / time.

  (3) vLLM (``--vllm``, default on where CUDA and vLLM are present): the same model saved to disk and served
      by the project's vLLM rollout (``vLLMRollout``: CUDA graphs, prefix caching off since every prompt is
      random), on the same prompts, lengths and sampling; lengths are forced with ``ignore_eos`` (fixed) and
      per-request ``max_tokens`` (mix). One engine per distinct slot count (``max_num_seqs``: the largest
      batch for (1), ``--mix-slots`` for (2)), built after the other rows; its start-up is not timed.

  (4) one decode step (``--cases step``): B slots holding ``--step-context`` tokens each in allocations of
      ``--step-alloc`` (the scale run early in a rollout: ~1k prompt tokens in prompt + 4k allocations), the
      step captured as a CUDA graph and replayed; milliseconds per step with the split-K decode attention and,
      with ``--torch-attention``, with the torch matmuls over the whole allocation.

    python benchmarks/bench_rollout.py                   # CUDA (fla needed for the fused kernels)
    python benchmarks/bench_rollout.py --smoke           # tiny model, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from common import fmt_table  # noqa: E402

_T0 = time.time()

SHAPE_0P8B = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                  max_position_embeddings=32768, tie_word_embeddings=True)
SHAPE_2B = dict(SHAPE_0P8B, hidden_size=2048, intermediate_size=6144)  # Qwen3.5-2B's layer shape
SHAPE_9B = dict(SHAPE_0P8B, hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
                num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False)  # Qwen3.5-9B's
SHAPES = {"0p8b": SHAPE_0P8B, "2b": SHAPE_2B, "9b": SHAPE_9B,
          # Qwen3.5-35B-A3B's layers (256 experts top-8), from the scale script's one definition (--layers of 40)
          "35b-a3b": "35b_a3b"}
SHAPE_SMOKE = dict(num_hidden_layers=4, vocab_size=2048)


def log(msg: str) -> None:
    print(f"[rollout +{time.time() - _T0:6.1f}s] {msg}", flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape, device, dtype, layers=None):
    """A random model of ``shape``: a dense shape's config kwargs, or the name of a gpu_scale.py shape (MoE)."""
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    if isinstance(shape, str):
        from gpu_scale import _config

        cfg = _config(shape, layers)
        cls = tf.Qwen3_5MoeForCausalLM if getattr(cfg, "num_experts", 0) else tf.Qwen3_5ForCausalLM
    else:
        cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(**shape))
        cfg.architectures, cls = ["Qwen3_5ForCausalLM"], tf.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    return model.to(dtype).eval()


def make_rollout(model, slots: int, prefill_tokens: int = 16384, **hf_kwargs):
    """The built-in engine over ``model``; ``prefill_tokens``: prompt tokens per packed prefill forward
    (rollout.max_num_batched_tokens)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl.workers.rollout.hf_rollout import HFRollout

    cfg = OmegaConf.create({"max_num_seqs": slots, "max_num_batched_tokens": prefill_tokens,
                            "engine_kwargs": {"hf": hf_kwargs}})
    return HFRollout(cfg, None, SimpleNamespace(pad_token_id=0, eos_token_id=1), module=model)


def random_prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, vocab, (n,), generator=g).tolist() for n in lengths]


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def hf_generate(model, prompts, new_tokens, device):
    lmax = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), lmax, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, lmax - len(p):] = torch.tensor(p)
        mask[i, lmax - len(p):] = 1
    from transformers import GenerationConfig

    with torch.no_grad():
        return model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0, generation_config=GenerationConfig())


def engine_generate(rollout, prompts, new_tokens, seed=0):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    return rollout.generate([GenerationRequest(p) for p in prompts],
                            SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[], seed=seed))


def decode_bytes(model, batch: int, context: float, state_bytes: int) -> float:
    """HBM traffic of one decode step, the memory-bound floor's numerator: every weight read once (the input
    embedding only for the batch's rows), each Gated DeltaNet layer's recurrent state read and written, and each
    full-attention layer's keys and values over ``context`` tokens read (bf16)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = getattr(cfg, "num_experts", 0)
    if experts:  # routed experts: only those the batch's tokens pick are read (expected count, uniform routing)
        routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
        touched = 1.0 - (1.0 - cfg.num_experts_per_tok / experts) ** batch
        weights -= routed * (1.0 - touched)
    if model.get_output_embeddings().weight is not emb:  # untied: the table itself is read for the batch's rows only
        weights += (batch * emb.shape[1] - emb.numel()) * emb.element_size()
    types = list(cfg.layer_types)
    state = types.count("linear_attention") * batch * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
        * cfg.linear_value_head_dim * state_bytes * 2
    kv = types.count("full_attention") * batch * context * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    return weights + state + kv


@contextlib.contextmanager
def torch_attention(on: bool):
    """The baseline row of ``--torch-attention``: the decode step's attention as the torch matmuls over each slot's
    whole allocation (what the engine ran before ``decode_kernels.decode_attention``), in the same run."""
    try:
        from verl.models.qwen3_5 import decode_kernels
    except ImportError:  # no triton (a CPU): the torch step is the only one
        on = False
    if not on:
        yield
        return

    saved = decode_kernels.attention_supported
    decode_kernels.attention_supported = lambda head_dim: False
    try:
        yield
    finally:
        decode_kernels.attention_supported = saved


def fixed_lengths(model, args, device, vocab) -> list[dict]:
    rows = []
    for b in args.batches:
        prompts = random_prompts([args.prompt_len] * b, vocab, seed=b)
        variants = [("engine", {})] + ([("engine, bf16 state", {"state_dtype": "bfloat16"})] if args.bf16_state else [])
        if args.torch_attention and device.type == "cuda":
            variants.append(("engine, torch attention", {}))
        for impl, kw in variants:
            rollout = make_rollout(model, b, args.prefill_tokens, **kw)
            with torch_attention(impl.endswith("torch attention")):
                engine_generate(rollout, prompts, 8)  # warm-up on the same prompts (prefill kernels for this shape)
                t, outs = timed(lambda: engine_generate(rollout, prompts, args.new_tokens), device)
            assert all(len(o[0].token_ids) == args.new_tokens for o in outs)
            st = rollout.last_stats
            rows.append(dict(case="fixed", batch=b, impl=impl, seconds=t, tokens=b * args.new_tokens,
                             tok_s=b * args.new_tokens / t, prefill_s=st["prefill_s"], capture_s=st["capture_s"],
                             warmup_s=st.get("warmup_s", 0.0), graphs=st.get("graphs", 0)))
            decode = t - st["prefill_s"] - st["capture_s"] - st.get("warmup_s", 0.0)
            step_bytes = decode_bytes(model, b, args.prompt_len + args.new_tokens / 2,
                                      2 if kw.get("state_dtype") == "bfloat16" else 4)
            rows[-1].update(decode_ms=1e3 * decode / args.new_tokens, step_gb=step_bytes / 1e9,
                            hbm_tb_s=step_bytes * args.new_tokens / decode / 1e12)
            log(f"{impl} B={b}: {t:.2f}s, {rows[-1]['tok_s']:,.0f} new tok/s (prefill {st['prefill_s']:.2f}s, warm-up "
                f"{st.get('warmup_s', 0.0):.2f}s, {st.get('graphs', 0)} graph(s) captured in {st['capture_s']:.2f}s, "
                f"decode {rows[-1]['decode_ms']:.2f} ms/step; {rows[-1]['step_gb']:.2f} GB of weights, state and KV "
                f"per step = {rows[-1]['hbm_tb_s']:.2f} TB/s of HBM traffic)")
        if not args.skip_generate:
            hf_generate(model, prompts[:2], 2, device)
            t, out = timed(lambda: hf_generate(model, prompts, args.new_tokens, device), device)
            assert out.shape[1] == args.prompt_len + args.new_tokens
            rows.append(dict(case="fixed", batch=b, impl="generate", seconds=t, tokens=b * args.new_tokens,
                             tok_s=b * args.new_tokens / t))
            log(f"generate B={b}: {t:.2f}s, {rows[-1]['tok_s']:,.0f} new tok/s")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_step_rows(model, args, device) -> list[dict]:
    """Case (4): one decode step's milliseconds at each batch, the slots ``--step-context`` tokens deep in
    ``--step-alloc``-token allocations (zeros: the time does not depend on the values)."""
    from verl.models.qwen3_5.hf_runner import Qwen35Runner
    from verl.workers.rollout.hf_engine.cache import SlotCache

    runner = Qwen35Runner(model)
    variants = ["engine"] + (["engine, torch attention"] if args.torch_attention and device.type == "cuda" else [])
    rows, table = [], []
    for b in args.batches:
        for impl in variants:
            cache = SlotCache(runner.shape, b, args.step_alloc, 1, device, runner.dtype)
            cache.lengths.fill_(args.step_context)
            with torch.no_grad(), torch_attention(impl.endswith("torch attention")):
                step = lambda: runner.decode_logits(cache, b)  # noqa: E731
                if device.type == "cuda":  # as the engine: warm up on a side stream, capture, replay
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            step()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    step = graph.replay
                repeat = 50 if device.type == "cuda" else 3
                step()
                sync(device)
                t0 = time.perf_counter()
                for _ in range(repeat):
                    step()
                sync(device)
            ms = 1e3 * (time.perf_counter() - t0) / repeat
            gb = decode_bytes(model, b, args.step_context, 4) / 1e9
            rows.append(dict(case="step", batch=b, impl=impl, decode_ms=ms, step_gb=gb, context=args.step_context,
                             alloc=args.step_alloc))
            table.append([b, impl, f"{ms:.2f}", f"{gb:.1f}", f"{gb / ms:.2f}"])
            del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n=== (4) one decode step, {args.step_context} tokens per slot in {args.step_alloc}-token allocations ===")
    print(fmt_table(["batch", "impl", "ms/step", "GB/step (weights, state, visible KV)", "TB/s"], table), flush=True)
    return rows


def profile_decode(model, args, device, vocab) -> None:
    """One engine call at the largest batch under the profiler: kernels inside the engine's ``hf_engine::decode``
    ranges (the decode steps: CUDA-graph replays), by kernel and by class, and the device's busy share."""
    from pathlib import Path

    from step_profile import by_class, class_markdown, profile_kernels
    from trace_top_kernels import in_windows, load_events, markdown, summarize, windows

    b = max(args.batches)
    prompts = random_prompts([args.prompt_len] * b, vocab, seed=b)
    rollout = make_rollout(model, b, args.prefill_tokens)
    engine_generate(rollout, prompts, args.profile_tokens)  # graphs captured outside the profiled call
    prof = profile_kernels(lambda: engine_generate(rollout, prompts, args.profile_tokens), device, args.profile,
                           f"engine_b{b}")
    print("\n" + prof["table"] + "\n", flush=True)
    events = load_events(Path(prof["trace"]))
    for phase in ("hf_engine::decode", "hf_engine::prefill"):
        spans = windows(events, phase)
        if not spans:
            print(f"(no {phase} range in the trace)")
            continue
        picked = summarize(in_windows(events, spans), top=10**9)
        head = dict(picked, rows=picked["rows"][:20])
        print(markdown(head, f"B={b}, {args.profile_tokens} new tokens: kernels inside {len(spans)} {phase} ranges")
              + "\n\n" + class_markdown(by_class(picked["rows"], picked["total_us"]), phase) + "\n", flush=True)


def mix_workload(args, vocab):
    """The length mix's prompts, group size n and per-sample response lengths (seeded: same for every impl)."""
    import numpy as np

    rng = np.random.default_rng(args.mix_seed)
    plens = rng.integers(args.mix_prompt[0], args.mix_prompt[1] + 1, args.mix_prompts).tolist()
    prompts = random_prompts(plens, vocab, seed=7)
    resp = np.clip(np.round(rng.lognormal(np.log(args.mix_median), args.mix_sigma, len(prompts) * args.mix_n)),
                   args.mix_clip[0], args.mix_clip[1]).astype(int).tolist()
    return prompts, args.mix_n, resp


def length_mix(model, args, device, vocab) -> list[dict]:
    from verl.workers.rollout.hf_engine.engine import DecodeEngine, SeqRequest
    from verl.workers.rollout.hf_engine.entry import engine_options, unsharded
    from verl.models.qwen3_5.hf_runner import PrefillSeq, Qwen35Runner
    from verl.workers.rollout.hf_engine.sampling import SamplerConfig, sequence_key

    prompts, n, resp = mix_workload(args, vocab)
    useful = sum(resp)
    slots = args.mix_slots
    log(f"length mix: {len(prompts)} prompts x n={n}, responses median {int(statistics.median(resp))}, max {max(resp)}, "
        f"{useful} useful tokens, {slots} slots")

    def seqs():
        out = []
        for i, p in enumerate(prompts):
            for k in range(n):
                out.append(SeqRequest(PrefillSeq(p), sequence_key(0, p, k), resp[i * n + k], ("p", i)))
        return out

    rows = []
    for impl, continuous in (("engine (static batches)", False), ("engine (continuous)", True)):
        opt, backend = engine_options(make_rollout(model, slots, args.prefill_tokens).config)
        opt.continuous = continuous
        engine = DecodeEngine(Qwen35Runner(model, backend), SamplerConfig(temperature=1.0), [], opt)
        with unsharded(model):
            engine.run(seqs())  # warm-up: the same workload once (prefill kernels for its packed shapes)
            t, res = timed(lambda: engine.run(seqs()), device)
        assert [len(r.tokens) for r in res] == resp
        st = opt.stats
        rows.append(dict(case="mix", batch=slots, impl=impl, seconds=t, tokens=useful, tok_s=useful / t,
                         mean_running=st["slot_steps"] / max(1, st["decode_steps"]), prefills=st["prefills"],
                         decode_steps=st["decode_steps"]))
        log(f"{impl}: {t:.2f}s, {useful / t:,.0f} useful tok/s, {st['prefills']} prefills, {st['decode_steps']} "
            f"decode steps, mean running sequences {rows[-1]['mean_running']:.1f} of {slots}")
    if not args.skip_generate:
        # generate in static batches of `slots` sequences (prompt-major order, as the trainer lays them out);
        # a batch runs to its longest member. Its time per step is measured on the first batch over
        # --mix-gen-steps steps (it is launch-bound, nearly flat in length) and charged to every batch's steps.
        flat = [p for p in prompts for _ in range(n)]
        batches = [list(range(s, min(s + slots, len(flat)))) for s in range(0, len(flat), slots)]
        steps0 = args.mix_gen_steps
        t0, _ = timed(lambda: hf_generate(model, [flat[i] for i in batches[0]], steps0, device), device)
        total = sum(t0 * max(resp[i] for i in b) / steps0 for b in batches)
        rows.append(dict(case="mix", batch=slots, impl="generate (static batches)", seconds=total,
                         tokens=useful, tok_s=useful / total))
        log(f"generate: first batch {t0:.2f}s for {steps0} steps; all {len(batches)} batches to their longest "
            f"member ~{total:.1f}s, {useful / total:,.0f} useful tok/s")
    return rows


def vllm_engine(model_dir: str, slots: int, max_len: int):
    """The project's colocated vLLM rollout on ``model_dir`` with ``slots`` sequences at a time."""
    from omegaconf import OmegaConf

    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    cfg = OmegaConf.create(dict(
        name="vllm", prompt_length=max_len // 2, response_length=max_len - max_len // 2, max_model_len=max_len,
        max_num_seqs=slots, dtype="bfloat16", enforce_eager=False, free_cache_engine=False, enable_sleep_mode=False,
        enable_prefix_caching=False, gpu_memory_utilization=0.5, load_format="auto",
        tensor_model_parallel_size=1, engine_kwargs=dict(vllm={})))
    return vLLMRollout(cfg, OmegaConf.create(dict(path=model_dir)), tokenizer=None)


def vllm_generate(rollout, prompts, max_tokens: list[int], seed: int = 0):
    """vLLM generation with forced lengths (``ignore_eos``), T=1, no top-k / top-p."""
    import vllm

    params = [vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=int(m), min_tokens=int(m),
                                  ignore_eos=True, seed=seed + i, detokenize=False)
              for i, m in enumerate(max_tokens)]
    outs = rollout.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


def vllm_rows(model, args, device, vocab) -> list[dict]:
    import gc
    import tempfile

    tmp = tempfile.mkdtemp(prefix="bench_vllm_")
    model.save_pretrained(tmp)  # bf16, the same weights the other rows ran
    rows = []
    cases = args.cases.split(",")
    plan = []
    if "fixed" in cases:
        plan.append(("fixed", max(args.batches), args.prompt_len + args.new_tokens))
    if "mix" in cases:
        plan.append(("mix", args.mix_slots, args.mix_prompt[1] + args.mix_clip[1]))
    for case, slots, max_len in plan:
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        rollout = vllm_engine(tmp, slots, max_len)
        log(f"vLLM engine for {case} ({slots} slots) up in {time.perf_counter() - t0:.1f}s")
        try:
            if case == "fixed":
                for b in args.batches:
                    prompts = random_prompts([args.prompt_len] * b, vocab, seed=b)
                    vllm_generate(rollout, prompts, [8] * b)  # warm-up, as for the other rows
                    t, lens = timed(lambda: vllm_generate(rollout, prompts, [args.new_tokens] * b), device)
                    assert lens == [args.new_tokens] * b, lens[:4]
                    rows.append(dict(case="fixed", batch=b, impl="vllm", seconds=t, tokens=b * args.new_tokens,
                                     tok_s=b * args.new_tokens / t))
                    log(f"vllm B={b}: {t:.2f}s, {rows[-1]['tok_s']:,.0f} new tok/s")
            else:
                prompts, n, resp = mix_workload(args, vocab)
                flat = [p for p in prompts for _ in range(n)]
                vllm_generate(rollout, flat, resp)  # warm-up: the same workload once
                t, lens = timed(lambda: vllm_generate(rollout, flat, resp), device)
                assert lens == resp
                rows.append(dict(case="mix", batch=slots, impl="vllm (continuous)", seconds=t, tokens=sum(resp),
                                 tok_s=sum(resp) / t))
                log(f"vllm mix: {t:.2f}s, {sum(resp) / t:,.0f} useful tok/s")
        finally:
            rollout.shutdown()
            del rollout
            gc.collect()
    return rows


def print_tables(rows, device_name, args):
    fixed = [r for r in rows if r["case"] == "fixed"]
    if fixed:
        print(f"\n=== (1) new tokens/s, Qwen3.5-{args.shape} shape, {device_name}: prompts {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens forced, sampling T=1 ===")
        table = []
        for b in args.batches:
            gen = next((r for r in fixed if r["batch"] == b and r["impl"] == "generate"), None)
            vl = next((r for r in fixed if r["batch"] == b and r["impl"] == "vllm"), None)
            ordered = ([gen] if gen else []) + [r for r in fixed if r["batch"] == b and r is not gen]
            for r in ordered:
                ratio = f"{r['tok_s'] / gen['tok_s']:.1f}x" if gen else "-"
                vs_vllm = f"{r['tok_s'] / vl['tok_s']:.2f}x" if vl else "-"
                table.append([b, r["impl"], f"{r['seconds']:.2f}", f"{r['tok_s']:,.0f}", ratio, vs_vllm])
        print(fmt_table(["batch", "impl", "seconds", "new tok/s", "vs generate", "vs vllm"], table))
    mix = [r for r in rows if r["case"] == "mix"]
    if mix:
        print(f"\n=== (2) GRPO-like length mix ({args.mix_prompts} prompts x n={args.mix_n}, responses log-normal "
              f"median {args.mix_median} sigma {args.mix_sigma} clipped {args.mix_clip}, {args.mix_slots} slots), "
              f"{device_name} ===")
        base = next((r["tok_s"] for r in mix if r["impl"].startswith("generate")), None)
        if base:
            print(f"generate: time per step measured over {args.mix_gen_steps} steps of the first batch, charged to "
                  f"every batch's longest member")
        vl = next((r["tok_s"] for r in mix if r["impl"].startswith("vllm")), None)
        table = [[r["impl"], f"{r['seconds']:.2f}", f"{r['tok_s']:,.0f}",
                  f"{r['tok_s'] / base:.1f}x" if base else "-",
                  f"{r['tok_s'] / vl:.2f}x" if vl else "-",
                  f"{r['mean_running']:.1f}" if "mean_running" in r else "-",
                  r.get("decode_steps", "-")] for r in mix]
        print(fmt_table(["impl", "seconds", "useful tok/s", "vs generate", "vs vllm", "mean running seqs",
                         "decode steps"], table))
    print(flush=True)


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--shape", default="0p8b", choices=sorted(SHAPES),
                   help="model shape (with --smoke: 35b-a3b takes the tiny MoE, the others the tiny dense model)")
    p.add_argument("--layers", type=int, default=None, help="layers of a MoE shape (default: the real model's)")
    p.add_argument("--cases", default="fixed,mix")
    p.add_argument("--mix-prompts", type=int, default=128)
    p.add_argument("--mix-n", type=int, default=4)
    p.add_argument("--mix-slots", type=int, default=128)
    p.add_argument("--mix-median", type=float, default=128)
    p.add_argument("--mix-sigma", type=float, default=0.9)
    p.add_argument("--mix-seed", type=int, default=0)
    p.add_argument("--mix-gen-steps", type=int, default=128, help="steps of generate timed for the mix")
    p.add_argument("--bf16-state", action="store_true", help="also an engine row with bf16 recurrent state")
    p.add_argument("--torch-attention", action="store_true",
                   help="also an engine row with the torch decode attention over the whole allocation (the baseline "
                   "of the split-K kernel)")
    p.add_argument("--step-context", type=int, default=1100, help="case step: tokens each slot holds")
    p.add_argument("--step-alloc", type=int, default=5120, help="case step: tokens each slot's allocation holds")
    p.add_argument("--prefill-tokens", type=int, default=16384,
                   help="the engine's prompt tokens per packed prefill forward (rollout.max_num_batched_tokens)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the fixed-length rows: one engine call at the largest batch under the torch profiler "
                        "(Chrome trace into DIR; the decode steps' top kernels and kernel classes printed)")
    p.add_argument("--profile-tokens", type=int, default=64, help="new tokens of the profiled call")
    p.add_argument("--vllm", default="auto", choices=["auto", "on", "off"],
                   help="vLLM rows (auto: where CUDA and vLLM are present)")
    args = p.parse_args(argv)
    args.mix_prompt, args.mix_clip = (100, 500), (16, 512)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke:
        shape, dtype = ("tiny_moe" if args.shape == "35b-a3b" else SHAPE_SMOKE), torch.float32
        args.shape = "tiny"
        args.batches, args.prompt_len, args.new_tokens = "2,4", 16, 8
        args.mix_prompts, args.mix_n, args.mix_slots, args.mix_median = 4, 2, 3, 6
        args.mix_prompt, args.mix_clip = (5, 20), (2, 16)
        args.mix_gen_steps = 4
        args.step_context, args.step_alloc = 12, 40
    else:
        shape, dtype = SHAPES[args.shape], torch.bfloat16
    args.batches = [int(b) for b in str(args.batches).split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model = build_model(shape, device, dtype, args.layers)
    log(f"device {name}, model {sum(x.numel() for x in model.parameters()) / 1e9:.3f} B params, {dtype}")
    vocab = model.config.vocab_size
    rows = []
    cases = args.cases.split(",")
    if "fixed" in cases:
        rows += fixed_lengths(model, args, device, vocab)
        print_tables(rows, name, args)
        if args.profile:
            profile_decode(model, args, device, vocab)
    if "step" in cases:
        rows += decode_step_rows(model, args, device)
    if "mix" in cases:
        rows += length_mix(model, args, device, vocab)
    if args.vllm == "on" or (args.vllm == "auto" and device.type == "cuda" and _vllm_installed()):
        rows += vllm_rows(model, args, device, vocab)
    print_tables(rows, name, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
