"""Where one benchmark step's time and memory go: the top kernels (torch profiler) and the allocations alive at
the step's memory peak (the CUDA caching allocator's history). Issue 23: "profile, then fix the largest items"
and "find where the memory goes".

Both take a zero-argument ``step`` callable that runs one full step (forward + backward) and return plain dicts
the benchmarks print and write to their JSON. They are for measurement runs, not for timing: the profiler and the
allocator's history both slow the step they watch.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from trace_top_kernels import load_events, markdown, summarize  # noqa: E402

# Kernel classes by name, first match wins (flash attention's kernels are CUTLASS kernels too, hence attention
# first). The names are those the kernels carry in a CUDA trace of this project's steps on Hopper.
KERNEL_CLASSES = [
    ("attention", r"flash|fmha|attention|_attn_|varlen|sdpa|softmax_warp"),  # _attn_: the decode step's split-K
    # this project's fused LM-head log-prob kernels (verl/utils/kernel/triton_linear_logprob.py) are `_fwd_kernel`
    # and `_bwd_dlogits_kernel`
    ("log-prob / LM head", r"^_fwd_kernel$|_bwd_dlogits|logprob|log_prob|entropy|lm_head|cross_entropy|vocab"),
    # fla's Triton kernels, its TileLang backward (named `kernel_kernel`), the conv, this project's decode step
    ("gated deltanet", r"chunk|delta|recompute_w_u|solve_tril|kkt|fwd_kernel_h|bwd_kernel_dhu|tilelang|"
                       r"^kernel_kernel$|l2norm|causal_conv|conv1d|fused_recurrent|gdn|wy_repr"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|wgmma|matmul|_mm_|grouped_mm|splitk"),
    ("norm", r"rms|norm"),
    ("communication", r"nccl|allreduce|all_gather|reduce_scatter|alltoall"),
    ("copy / fill", r"memcpy|memset|copy|fill|cat_|catarray|index|gather|scatter"),
    ("elementwise / other", r"."),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, low):
            return cls
    return "elementwise / other"


def by_class(summary_rows: list[dict], total_us: float) -> list[dict]:
    """Device time per kernel class (the rows of ``trace_top_kernels.summarize`` with ``top`` large enough to hold
    every kernel name)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for r in summary_rows:
        a = acc[kernel_class(r["name"])]
        a[0] += r["us"]
        a[1] += r["count"]
    return [{"class": c, "us": us, "share": us / max(total_us, 1e-9), "count": int(n)}
            for c, (us, n) in sorted(acc.items(), key=lambda kv: -kv[1][0])]


def profile_kernels(step: Callable[[], object], device: torch.device, out_dir: str, name: str,
                    top: int = 20) -> dict:
    """Runs ``step`` once under the torch profiler; writes the Chrome trace (gzipped) to ``out_dir`` and returns
    the top kernels, the kernel classes and the device's busy share of the step."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    raw = os.path.join(out_dir, f"{name}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    events = load_events(Path(raw + ".gz"))
    full = summarize(events, top=10**9)
    classes = by_class(full["rows"], full["total_us"])
    head = dict(full, rows=full["rows"][:top])
    return {"wall_s": wall, "trace": raw + ".gz", "summary": head, "classes": classes,
            "table": markdown(head, f"{name}: top {top} kernels of one step (profiled, {wall:.2f} s wall)"),
            "class_table": class_markdown(classes, name)}


def class_markdown(classes: list[dict], name: str) -> str:
    lines = [f"#### {name}: device time by kernel class", "", "| class | ms | share | launches |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {c['class']} | {c['us'] / 1e3:.1f} | {100 * c['share']:.1f} % | {c['count']:,} |" for c in classes]
    return "\n".join(lines)


# Frames that say nothing about who asked for the memory (the allocator, autograd's engine, torch's own wrappers)
_SKIP_FRAME = re.compile(r"torch/(utils|autograd|_tensor|nn/modules/module|_ops|_dynamo|distributed/_tensor)|"
                         r"<frozen|site-packages/torch/_|^\?\?$|step_profile\.py")


def _site(frames: list[dict]) -> str:
    """The innermost Python frame outside torch's plumbing: file:line function."""
    for f in frames:
        fn = f.get("filename", "")
        if not fn or fn == "??" or _SKIP_FRAME.search(fn) or fn.endswith((".cpp", ".h", ".cu")):
            continue
        short = re.sub(r"^.*?/(verl|megatron|transformers|fla|torch|benchmarks)/", r"\1/", fn)
        return f"{short}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no Python frame)"


def memory_at_peak(step: Callable[[], object], device: torch.device, top: int = 15) -> dict:
    """Runs ``step`` once with the allocator's history on; returns the memory resident before the step, the peak
    during it, and the allocations made during the step that were alive at the peak, grouped by the Python line
    that made them (activations saved for backward, workspaces, gradient buffers created lazily)."""
    if device.type != "cuda":
        step()
        return {"resident_gib": float("nan"), "peak_gib": float("nan"), "sites": [], "table": "(CPU: no allocator "
                "history)"}
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated(device)
    trace = snap["device_traces"][device.index or 0]
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for ev in trace:
        act, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if act == "alloc":
            live[addr] = (size, _site(ev.get("frames", [])))
            cur += size
            if cur > best:
                best, best_live = cur, dict(live)
        elif act in ("free_completed",) and addr in live:
            cur -= live.pop(addr)[0]
    per_site: dict[str, int] = defaultdict(int)
    for size, site in best_live.values():
        per_site[site] += size
    sites = sorted(per_site.items(), key=lambda kv: -kv[1])
    rows = [{"site": s, "gib": b / 2**30} for s, b in sites[:top]]
    gib = 2**30
    lines = [f"resident before the step {resident / gib:.2f} GiB; peak {peak / gib:.2f} GiB; allocated during the "
             f"step and alive at its peak {best / gib:.2f} GiB, by the line that allocated it:", "",
             "| GiB | allocated at |", "| ---: | --- |"]
    lines += [f"| {r['gib']:.2f} | `{r['site']}` |" for r in rows]
    rest = sum(b for _, b in sites[top:])
    if rest:
        lines.append(f"| {rest / gib:.2f} | ({len(sites) - top} other lines) |")
    return {"resident_gib": resident / gib, "peak_gib": peak / gib, "step_live_at_peak_gib": best / gib,
            "sites": rows, "table": "\n".join(lines)}
