"""Speculative decoding with the MTP head (``mtp.enable_rollout``) vs plain decoding in the ``hf`` engine.

Same process, same model, same prompts; one row per configuration, new tokens/s = B x new tokens / wall time of
the whole ``HFRollout.generate`` call (prefill included), after one small warm-up call of each:

  * ``plain (graphs)``: the plain decode loop with CUDA graphs (the production default);
  * ``plain (eager)``: the plain loop without graphs (speculative steps run eagerly, so this is the like-for-like
    baseline of the mechanism itself);
  * ``spec k=K``: speculative decoding drafting K tokens per step; its acceptance rate and the tokens a sequence
    gains per verification step are printed with it.

The model: ``--model-path`` (a Qwen3.5 checkpoint with its ``mtp.*`` head, loaded as the trainer loads it), or a
randomly initialised one (``--shape``, bf16) with a random MTP head. A random head is almost never right
(acceptance ~0: the overhead bound); ``--drafter exact`` turns the random model into one whose head drafts what the
model samples (:func:`verl.models.qwen3_5.tiny.make_mtp_head_exact`, acceptance 1: the upper bound). Neither is a
real model's figure; only ``--model-path`` with a trained checkpoint is.

    python benchmarks/bench_speculative.py --k 1,2 --drafter exact        # CUDA
    python benchmarks/bench_speculative.py --smoke                        # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import SHAPE_SMOKE, SHAPES, random_prompts, sync  # noqa: E402
from common import fmt_table  # noqa: E402


def build(args, device, dtype):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5, make_mtp_head_exact

    if args.model_path:
        import transformers as tf

        from verl.models.qwen3_5.mtp import attach_mtp

        model = tf.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(device)
        attach_mtp(model, args.model_path)
        return model.eval()
    shape = SHAPE_SMOKE if args.smoke else SHAPES[args.shape]
    model = build_tiny_qwen3_5(None, kind="dense", seed=0, with_tokenizer=False, mtp_num_hidden_layers=1,
                               **shape).to(device, dtype).eval()
    if args.drafter == "exact":
        make_mtp_head_exact(model)
    return model


def rollout(model, slots: int, k: int, eager: bool):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl.workers.rollout.hf_rollout import HFRollout

    cfg = OmegaConf.create({"max_num_seqs": slots, "max_num_batched_tokens": 16384, "enforce_eager": eager})
    mtp = {"enable": True, "enable_rollout": k > 0, "num_speculative_tokens": max(k, 1)}
    return HFRollout(cfg, OmegaConf.create({"mtp": mtp}), SimpleNamespace(pad_token_id=0, eos_token_id=1),
                     module=model)


def generate(r, prompts, new_tokens, temperature):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    return r.generate([GenerationRequest(p) for p in prompts],
                      SamplingParams(temperature=temperature, max_tokens=new_tokens, stop_token_ids=[], seed=0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--model-path", default=None, help="a Qwen3.5 checkpoint with mtp.* weights")
    p.add_argument("--shape", default="0p8b", choices=sorted(SHAPES))
    p.add_argument("--drafter", default="random", choices=["random", "exact"], help="random models only")
    p.add_argument("--k", default="1,2", help="draft tokens per step, comma-separated")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.batches, args.prompt_len, args.new_tokens = "2,4", 16, 16
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build(args, device, dtype)
    vocab = model.config.vocab_size
    ks = [int(k) for k in args.k.split(",") if k]
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = random_prompts([args.prompt_len] * b, vocab, seed=b)
        configs = [("plain (graphs)", 0, False), ("plain (eager)", 0, True)]
        configs += [(f"spec k={k}", k, True) for k in ks]
        if device.type != "cuda":
            configs = [c for c in configs if c[0] != "plain (graphs)"]
        for name, k, eager in configs:
            r = rollout(model, b, k, eager)
            generate(r, prompts[:2], 8, args.temperature)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            generate(r, prompts, args.new_tokens, args.temperature)
            sync(device)
            wall = time.perf_counter() - t0
            m = r.engine_metrics
            rows.append({"batch": b, "config": name, "tokens_per_s": b * args.new_tokens / wall, "wall_s": wall,
                         "accept_rate": m.get("perf/hf_engine/spec_accept_rate"),
                         "accept_length": m.get("perf/hf_engine/spec_accept_length")})
            print(f"[spec] B={b} {name}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nspeculative vs plain decoding, {name}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"T={args.temperature}, drafter {'checkpoint' if args.model_path else args.drafter}")
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["config"] == "plain (eager)"}
    print(fmt_table(["B", "config", "tokens/s", "vs plain eager", "accept rate", "tokens/step"], [
        [r["batch"], r["config"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base[r['batch']]:.2f}x",
         "-" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}",
         "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
