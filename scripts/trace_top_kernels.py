"""Top GPU kernels of torch.profiler Chrome traces, as a markdown table (issue 20 / 23: "profile, then fix the
largest items").

    python scripts/trace_top_kernels.py TRACE.json [TRACE2.json.gz ...] [--top 25] [--match update]

For each trace: the device time per kernel name (summed over launches), its share of all device time, the
launch count and the mean duration; then the busy fraction of the device over the traced span. A low busy
fraction with many short kernels means the step is bound by launches / host work, not by the kernels. Traces
without device events (a CPU run) are summarised over their CPU operators instead.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """Time covered by at least one span (kernels on several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def windows(events: list[dict], name: str) -> list[tuple[float, float]]:
    """Spans of the ``record_function`` ranges whose name ends with ``name`` (the workers mark each role call as
    ``verl::<method>``), on the device timeline where the trace has it, else on the host's."""
    for cats in (("gpu_user_annotation",), ("user_annotation",)):
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") in cats and str(e.get("name", "")).endswith(name)]
        if spans:
            return spans
    return []


def in_windows(events: list[dict], spans: list[tuple[float, float]]) -> list[dict]:
    """Events that start inside one of ``spans`` (device events launched near a range's end can start after
    it: host ranges are extended by their own 2 % for that lag)."""
    wide = [(s, e + 0.02 * (e - s)) for s, e in spans]
    return [ev for ev in events if any(s <= float(ev["ts"]) <= e for s, e in wide)]


def summarize(events: list[dict], top: int = 25) -> dict:
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    chosen, kind = (device, "device") if device else ([e for e in events if e.get("cat") == "cpu_op"], "cpu_op")
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in chosen:
        per_name[e["name"]].append(float(e["dur"]))
    total = sum(sum(v) for v in per_name.values())
    rows = sorted(((sum(v), len(v), name) for name, v in per_name.items()), reverse=True)[:top]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in chosen]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    busy = _merged_busy(spans) if kind == "device" else None
    return {"kind": kind, "total_us": total, "span_us": span, "busy_us": busy, "launches": len(chosen),
            "rows": [{"name": n, "us": t, "count": c} for t, c, n in rows]}


def markdown(summary: dict, title: str) -> str:
    total = summary["total_us"] or 1.0
    lines = [f"### {title}", "",
             f"{summary['kind']} events: {summary['launches']:,}, summed {summary['total_us'] / 1e6:.3f} s over a "
             f"span of {summary['span_us'] / 1e6:.3f} s"
             + (f"; device busy {100 * summary['busy_us'] / max(summary['span_us'], 1.0):.1f} % of the span"
                if summary["busy_us"] is not None else ""), "",
             "| # | kernel | total ms | share | launches | mean us |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(summary["rows"], 1):
        name = r["name"].replace("|", "/")
        name = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| {i} | `{name}` | {r['us'] / 1e3:.1f} | {100 * r['us'] / total:.1f} % | {r['count']:,} | "
                     f"{r['us'] / r['count']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="Chrome trace files or folders holding them")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--match", default=None, help="only traces whose path contains this text")
    p.add_argument("--window", action="append", default=[],
                   help="only events inside the role call of this name (e.g. update_actor); repeatable, one "
                        "table each")
    args = p.parse_args(argv)
    files: list[Path] = []
    for t in args.traces:
        files += sorted(t.rglob("*.json*")) if t.is_dir() else [t]
    files = [f for f in files if f.name.endswith((".json", ".json.gz")) and (not args.match or args.match in str(f))]
    if not files:
        print(f"no trace files under {[str(t) for t in args.traces]}", file=sys.stderr)
        return 1
    for f in files:
        events = load_events(f)
        if not args.window:
            print(markdown(summarize(events, args.top), str(f)) + "\n", flush=True)
        for name in args.window:
            spans = windows(events, name)
            if not spans:
                print(f"### {f}: no `{name}` range in this trace\n", flush=True)
                continue
            picked = in_windows(events, spans)
            print(markdown(summarize(picked, args.top), f"{f} - {name} ({len(spans)} calls)") + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
