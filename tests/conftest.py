"""Settings for every test process and the processes it starts (main_ppo runs, Ray clusters).

Ray starts its worker processes (where the Ray launcher's actors train) at niceness 15, below the pytest
process and every other nice-0 process. On CI's 2-core machine two pytest lanes and the vLLM lane run side by
side, so a Ray actor competing with a nice-0 test of the other lane gets a small fraction of a core: a Ray run
of the demo took five times as long there as alone, while the in-process launcher's runs did not slow down at
all. Measured here with two nice-0 busy loops running: creating the demo's Ray worker group took 166 s at
niceness 15 and 19 s at niceness 0. Niceness 0 gives Ray workers the same share as every other test process;
the work they do is unchanged. setdefault: a developer's own RAY_worker_niceness wins.

Where ``VERL_CPU_THREADS`` is set (CI sets 1: three lanes share two cores), the pytest process itself computes
with that many intra-op threads too, as the workers it starts do. Tests that train a tiny model in process
(the multi-turn test's nudge: 30 AdamW steps) took 23-28 s with torch's default 2 threads beside two 2-thread
matmul loops, against 11 s with 1 (2026-11-27, this 2-core machine); alone they take 2.8 s. With it CI's two
pytest lanes took 17 min each instead of 26-27 (2026-11-27, same machine).
"""

import os

# Read by the Ray node a test starts (ray.init in process or in a main_ppo subprocess, `ray start`), which
# hands it to the workers it spawns.
os.environ.setdefault("RAY_worker_niceness", "0")

if os.environ.get("VERL_CPU_THREADS"):
    import torch

    from verl.utils.device import cpu_threads_per_worker

    torch.set_num_threads(cpu_threads_per_worker(1))
