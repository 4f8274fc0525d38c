"""Long packed sequences on the Megatron engine with context parallelism (Qwen3.5 local spec, no Transformer Engine).

    python scripts/gpu_megatron_cp.py                 # one train step on a 32k-token sequence at CP=1 and CP=2
    python scripts/gpu_megatron_cp.py --dry-run       # CPU: the engine sections and the memory estimate only
    ... --length 32768 --shape 0p8b --layers 16 --cps 1 2 --probe 4096 8192

Each CP size runs in its own processes (world size = CP, one GPU each): the engine (bf16, distributed optimizer,
no activation recompute) takes one optimizer step on one packed sequence of ``--length`` tokens; the report is
the peak GPU memory per rank, or OOM. The probe lengths run first at CP=1 and give the measured bytes per token,
from which the target length's peak is predicted for each CP size (activations split by CP; model and optimizer
state constant). Without recompute the activations dominate: the estimate below (``--dry-run``) prices them
from the layer shapes, and the probe replaces it with a measurement.

Estimate for the 0.8B shape (hidden 1024, 24 layers: 18 Gated DeltaNet + 6 attention, MLP 3584, bf16): saved
activations per token per layer are about 2 x hidden x (2 + 4 + 4) bytes for the two zero-centred RMSNorms (input,
fp32 copy, fp32 normalised), 2 hidden + 10 x intermediate for the gated MLP, and for the mixer the projection
outputs, the conv input and output, the delta rule's q/k/v/g/beta and the gated norm's fp32 operands (GDN, ~100 KB)
or q/k/v, the fp32 q/k norms, rotary copies and the SDPA output (attention, ~60 KB). That is ~3.5 MB per token,
~131 GiB per GPU at 32k tokens at CP=1 and ~70 GiB at CP=2 (weights, fp32 grads and Adam state included).
The estimate runs high by about a quarter. Measured on 2 x H100 80GB (2026-11-27, fla 0.6.0, megatron-core 0.19.2):
with 16 layers 32k tokens fit at CP=1 (69.4 GiB against 90.8 estimated) and CP=2 (40.3 against 49.9); with the
shape's own 24 layers CP=1 ran out of memory (76.8 GiB reached) and CP=2 fitted at 55.8 GiB (70.5 estimated),
a 5.2 s step. So the default is the 0.8B shape's own 24 layers; on cards above 100 GiB (a 141 GB H200, where 24
layers would fit at CP=1) it is 48 layers (~190 GiB at CP=1 and ~100 GiB at CP=2 after the same correction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

GIB = 1024 ** 3
DEFAULT_LAYERS = 24  # the 0.8B shape's own; see the module docstring: on an 80 GB card 32k tokens OOM at CP=1, fit at CP=2
# A 141 GB H200 would fit the 24-layer step at CP=1 (~100 GiB measured-corrected), so on cards above 100 GiB the
# default doubles the layers.
LARGE_CARD_GIB, LARGE_CARD_LAYERS = 100, 48


def default_layers() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory / GIB > LARGE_CARD_GIB:
        return LARGE_CARD_LAYERS
    return DEFAULT_LAYERS


def shape_kwargs(shape: str, layers: int | None) -> dict:
    from gpu_grpo_step import SHAPES

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
        kw.pop("layer_types", None)
    return kw


def engine_section(cp: int) -> dict:
    """The ``actor_rollout_ref.actor.megatron`` section the run uses (upstream's keys)."""
    return {"context_parallel_size": cp, "use_remove_padding": True, "dtype": "bfloat16",
            "use_distributed_optimizer": True, "seed": 7, "override_transformer_config": {}}


def estimate_bytes(kw: dict, length: int, cp: int) -> dict:
    """Rough peak memory of one train step (see the module docstring): model state + saved activations / cp."""
    h, inter, layers = kw["hidden_size"], kw["intermediate_size"], kw.get("num_hidden_layers", 24)
    n_attn = layers // 4  # every 4th layer is full attention (the tiny config's pattern)
    n_gdn = layers - n_attn
    kd = kw["linear_num_key_heads"] * kw["linear_key_head_dim"]
    vd = kw["linear_num_value_heads"] * kw["linear_value_head_dim"]
    qd = kw["num_attention_heads"] * kw["head_dim"]
    kvd = kw["num_key_value_heads"] * kw["head_dim"]
    norms = 2 * h * (2 + 4 + 4)
    mlp = 2 * h + 10 * inter
    # input, projections, conv input/output (x3 with silu), delta-rule inputs, its fp32 chunk matrices, the gated
    # norm's fp32 operands, the output projection's input
    gdn = (2 * h + 2 * (2 * kd + 2 * vd) + 2 * (2 * kd + vd) * 3 + 2 * (2 * kd + vd)
           + 4 * 64 * kw["linear_num_value_heads"] + 4 * vd * 4 + 2 * vd)
    attn = 2 * (2 * qd + 2 * kvd) + 4 * (qd + kvd) * 2 + 2 * (qd + kvd) * 2 + 2 * qd * 4
    per_token = n_gdn * (gdn + mlp + norms) + n_attn * (attn + mlp + norms)
    params = _param_count(kw)
    # bf16 params + fp32 grad buffer + (fp32 master + 2 Adam moments) split over the dp x cp ranks
    state = params * (2 + 4) + params * 12 / cp
    logits = 2048 * kw["vocab_size"] * 4 * 3  # one checkpointed chunk of fp32 logits, softmax and its grad
    return {"per_token": per_token, "state": state, "activations": per_token * length / cp, "logits": logits,
            "total": state + per_token * length / cp + logits, "params": params}


def _param_count(kw: dict) -> int:
    h, inter, vocab = kw["hidden_size"], kw["intermediate_size"], kw["vocab_size"]
    layers = kw.get("num_hidden_layers", 24)
    n_attn = layers // 4
    kd = kw["linear_num_key_heads"] * kw["linear_key_head_dim"]
    vd = kw["linear_num_value_heads"] * kw["linear_value_head_dim"]
    qd = kw["num_attention_heads"] * kw["head_dim"]
    kvd = kw["num_key_value_heads"] * kw["head_dim"]
    gdn = h * (2 * kd + 2 * vd + 2 * kw["linear_num_value_heads"]) + vd * h + (2 * kd + vd) * 4
    attn = h * (2 * qd + 2 * kvd) + qd * h
    return vocab * h + layers * 3 * h * inter + (layers - n_attn) * gdn + n_attn * attn


def _worker(rank: int, world: int, model_dir: str, length: int, out_file: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from verl.protocol import DataProto
    from verl.workers.engine.megatron import MegatronEngine

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    result = {"cp": world, "length": length}
    try:
        optim = OmegaConf.create({"lr": 1e-6, "clip_grad": 1.0, "weight_decay": 0.0, "total_training_steps": 1})
        eng = MegatronEngine(OmegaConf.create({"path": model_dir}), OmegaConf.create(engine_section(world)), optim,
                             None, role="actor")
        eng.initialize()
        torch.cuda.reset_peak_memory_stats()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 50000, (1, length), generator=g)
        data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "position_ids": torch.arange(length)[None]},
                                   meta_info={"micro_batch_size": 1, "temperature": 1.0})

        def loss_fn(outs, mb):
            info = mb["global_batch_info"]
            loss = -outs["log_probs"][:, :-1].sum() / info["batch_num_tokens"] * info["dp_size"]
            return loss, {"loss": loss.detach()}

        t0 = time.time()
        metrics = eng.train_batch(data, loss_fn)
        torch.cuda.synchronize()
        result.update(status="ok", seconds=round(time.time() - t0, 2), loss=float(metrics["loss"]),
                      grad_norm=float(metrics["grad_norm"]))
    except torch.OutOfMemoryError as exc:
        result.update(status="oom", error=str(exc).splitlines()[0][:200])
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    result["total_gib"] = round(torch.cuda.get_device_properties(rank).total_memory / GIB, 2)
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    if result["status"] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run_one(model_dir: Path, cp: int, length: int, work: Path, timeout: float) -> dict:
    import torch.multiprocessing as tmp

    out = work / f"cp{cp}_{length}.json"
    if out.exists():
        out.unlink()
    ctx = tmp.get_context("spawn")
    port = 29700 + (os.getpid() + cp * 7 + length) % 200
    procs = [ctx.Process(target=_worker, args=(r, cp, str(model_dir), length, str(out), port)) for r in range(cp)]
    t0 = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.time() - t0)))
    for p in procs:
        if p.is_alive():  # a rank that ran out of memory leaves its peer waiting in a collective
            p.kill()
            p.join()
    result = json.loads(out.read_text()) if out.exists() else {"cp": cp, "length": length, "status": "no result"}
    result["exitcodes"] = [p.exitcode for p in procs]
    print(f"[megatron cp] {json.dumps(result)}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--shape", default="0p8b")
    p.add_argument("--layers", type=int, default=None,
                   help=f"the shape's number of layers (0: the shape's; default {DEFAULT_LAYERS}, {LARGE_CARD_LAYERS} on "
                        f"cards above {LARGE_CARD_GIB} GiB)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--probe", type=int, nargs="*", default=[4096, 8192],
                   help="CP=1 lengths measured first: their peaks give the bytes per token")
    p.add_argument("--workdir", default="/tmp/verl_megatron_cp")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    p.add_argument("--dry-run", action="store_true", help="print the engine sections and the estimate; no GPU")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = DEFAULT_LAYERS if args.dry_run else default_layers()
    kw = shape_kwargs(args.shape, args.layers)
    from verl.workers.engine.megatron.settings import read_settings

    for cp in args.cps:
        est = estimate_bytes(kw, args.length, cp)
        s = read_settings(engine_section(cp))  # the section is a valid engine config
        print(f"[megatron cp] shape {args.shape} ({est['params'] / 1e9:.2f} B params, {kw['num_hidden_layers']} "
              f"layers), {args.length} tokens, CP={s.cp}: estimate {est['per_token'] / 2 ** 20:.2f} MiB/token of "
              f"activations -> {est['activations'] / GIB:.1f} GiB + state {est['state'] / GIB:.1f} GiB + logits "
              f"{est['logits'] / GIB:.1f} GiB = {est['total'] / GIB:.1f} GiB per GPU", flush=True)
    if args.dry_run:
        return 0
    import torch

    from gpu_grpo_step import SHAPES, build_checkpoint

    if torch.cuda.device_count() < max(args.cps):
        print(f"needs {max(args.cps)} GPUs, found {torch.cuda.device_count()}")
        return 2
    work = Path(args.workdir)
    model_dir = work / f"{args.shape}_l{kw['num_hidden_layers']}"
    if not (model_dir / "config.json").exists():
        SHAPES["_cp_run"] = kw
        build_checkpoint(model_dir, False, "cuda", shape="_cp_run")
    results = []
    probes = [run_one(model_dir, 1, n, work, args.timeout) for n in args.probe]
    ok = [r for r in probes if r.get("status") == "ok"]
    if len(ok) >= 2:
        (a, b) = ok[0], ok[-1]
        slope = (b["peak_gib"] - a["peak_gib"]) / (b["length"] - a["length"])
        base = a["peak_gib"] - slope * a["length"]
        for cp in args.cps:
            print(f"[megatron cp] measured {slope * 1024:.3f} MiB/token at CP=1; predicted peak at "
                  f"{args.length} tokens, CP={cp}: {base + slope * args.length / cp:.1f} GiB (state/constant part "
                  f"{base:.1f} GiB taken as at CP=1)", flush=True)
    for cp in args.cps:
        results.append(run_one(model_dir, cp, args.length, work, args.timeout))
    print("\n| CP | tokens | status | peak GiB per GPU | step s |")
    print("|---|---|---|---|---|")
    for r in probes + results:
        print(f"| {r['cp']} | {r['length']} | {r.get('status')} | {r.get('peak_gib', '-')} | {r.get('seconds', '-')} |")
    fits = {r["cp"]: r.get("status") == "ok" for r in results}
    return 0 if fits.get(max(args.cps)) else 1


if __name__ == "__main__":
    sys.exit(main())
