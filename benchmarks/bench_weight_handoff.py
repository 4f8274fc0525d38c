"""Full-weight hand-over between two Ray workers (the asynchronous modes' trainer pool -> rollout pool), through
the controller, as the project did it before and as :mod:`verl.workers.weight_sync.handoff` does it now.

Two Ray actors on this host: a "trainer" holding the weights of a Qwen3.5 shape (bf16, random) and a "rollout"
holding a second copy. One hand-over = the trainer exports, the controller forwards, the rollout copies every
tensor into its own parameters. Rows:

  list     the trainer returns ``[(name, tensor)]`` (host copies); the controller receives it and passes it to the
           rollout actor (the tensors are pickled into the object store and out of it twice);
  package  the trainer returns ``handoff.pack(...)`` (the bytes put into the object store once, by the trainer);
           the controller forwards the small package; the rollout maps the arrays and copies them in.

Seconds per hand-over (median of ``--repeat`` after one warm-up), and the ratio to ``list`` measured in the same
run. The weights stay on the host on both sides here (a CPU machine); on GPUs both rows add the same
device <-> host copies.

    python benchmarks/bench_weight_handoff.py                # Qwen3.5-0.8B shape (1.5 GB in bf16)
    python benchmarks/bench_weight_handoff.py --smoke        # tiny shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import SHAPE_0P8B  # noqa: E402  (the 0.8B layer shape the rollout bench times)
from common import fmt_table  # noqa: E402


def shapes(smoke: bool) -> list[tuple[str, tuple[int, ...]]]:
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(**({} if smoke else SHAPE_0P8B)))
    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def make_actors(named_shapes):
    import ray

    @ray.remote
    class Trainer:
        def __init__(self, named_shapes):
            g = torch.Generator().manual_seed(0)
            self.weights = [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in named_shapes]

        def export_list(self):
            return [(n, t.to("cpu", copy=True)) for n, t in self.weights]

        def export_package(self):
            from verl.workers.weight_sync.handoff import pack

            return pack(self.weights)

        def checksum(self):
            return float(sum(t.float().sum() for _, t in self.weights))

    @ray.remote
    class Rollout:
        def __init__(self, named_shapes):
            self.params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in named_shapes}

        def load(self, weights):
            from verl.workers.weight_sync.handoff import unpack

            for n, t in unpack(weights):
                self.params[n].copy_(t)
            return len(self.params)

        def checksum(self):
            return float(sum(t.float().sum() for t in self.params.values()))

    return Trainer.remote(named_shapes), Rollout.remote(named_shapes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    import ray

    named = shapes(args.smoke)
    gb = sum(torch.Size(s).numel() for _, s in named) * 2 / 1e9
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer, rollout = make_actors(named)
        ray.get([trainer.checksum.remote(), rollout.checksum.remote()])
        rows = {}
        for row, export in (("list", trainer.export_list), ("package", trainer.export_package)):
            times = []
            for i in range(args.repeat + 1):
                t0 = time.perf_counter()
                weights = ray.get(export.remote())
                ray.get(rollout.load.remote(weights))
                if i:
                    times.append(time.perf_counter() - t0)
                del weights
            assert abs(ray.get(trainer.checksum.remote()) - ray.get(rollout.checksum.remote())) < 1e-3 * max(1.0, gb)
            rows[row] = statistics.median(times)
            print(f"[handoff] {row}: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    finally:
        ray.shutdown()
    base = rows["list"]
    print(f"\n=== full-weight hand-over between two Ray workers via the controller: {len(named)} tensors, "
          f"{gb:.2f} GB bf16, {os.cpu_count()} CPUs ===")
    print(fmt_table(["row", "seconds (median)", "vs list"],
                    [[r, f"{t:.2f}", f"{t / base:.2f}x"] for r, t in rows.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
