"""Seconds per step of the embedded GRPO demo (``python -m verl.trainer.main_ppo``), this tree against another.

Each run is a fresh ``main_ppo`` process on the demo with ``--steps`` steps and no validation; a run's figure
is the median of its logged ``timing_s/step`` after ``--skip`` warm-up steps. Runs alternate between the trees
(A B A B ...), so a machine whose speed drifts (shared CPUs) affects both alike, and the ratio is taken pair
by pair. Typical use: a baseline tree exported from an older commit,

    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/bench_demo_step.py --baseline /tmp/base --pairs 3 --steps 20

Nothing is asserted; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(tree: Path, steps: int, skip: int, extra: list[str]) -> tuple[float, float]:
    """(median s/step after ``skip`` steps, whole-process wall seconds) of one demo run from ``tree``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"trainer.total_training_steps={steps}",
               "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.default_local_dir={out}",
               *extra]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"demo from {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        metrics = next(Path(out).glob("runs/*/metrics.jsonl"))
        times = [json.loads(line)["data"].get("timing_s/step") for line in metrics.read_text().splitlines()]
        times = [t for t in times if t is not None][skip:]
        return statistics.median(times), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another source tree to compare against (run as B)")
    ap.add_argument("--pairs", type=int, default=3, help="runs of each tree")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out (imports, allocator warm-up)")
    ap.add_argument("overrides", nargs="*", help="extra main_ppo overrides for both trees")
    args = ap.parse_args()
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    for i in range(args.pairs):
        for name, tree in trees.items():
            res[name].append(run_demo(tree, args.steps, args.skip, args.overrides))
            step, wall = res[name][-1]
            print(f"run {i + 1} {name}: {step:.3f} s/step, {wall:.1f} s wall", flush=True)
    print(f"\n| tree | s/step (median of runs) | wall s | runs |\n| --- | ---: | ---: | ---: |")
    for name, rows in res.items():
        print(f"| {name} | {statistics.median(r[0] for r in rows):.3f} | "
              f"{statistics.median(r[1] for r in rows):.1f} | {len(rows)} |")
    if args.baseline:
        ratios = [a[0] / b[0] for a, b in zip(res["this"], res["baseline"])]
        print(f"\nthis / baseline s/step, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
