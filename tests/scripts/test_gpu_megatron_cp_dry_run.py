"""The long-context script (scripts/gpu_megatron_cp.py, run on a 2-GPU host) stays runnable: its engine sections
are valid Megatron settings with context parallelism, and its memory estimate puts a 32k-token step of the 0.8B
shape over an 80 GB H100 at CP=1 and under it at CP=2 for the default it runs (the shape's own 24 layers; measured
on 2 x H100: CP=1 out of memory, CP=2 55.8 GiB)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_builds_the_cp_sections_and_the_estimate():
    proc = subprocess.run([sys.executable, "scripts/gpu_megatron_cp.py", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[megatron cp]")]
    assert len(lines) == 2 and "CP=1" in lines[0] and "CP=2" in lines[1]


def test_estimate_splits_activations_over_cp():
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_megatron_cp as script

    from verl.workers.engine.megatron.settings import read_settings

    assert read_settings(script.engine_section(2)).cp == 2
    kw = script.shape_kwargs("0p8b", script.DEFAULT_LAYERS)
    one, two = script.estimate_bytes(kw, 32768, 1), script.estimate_bytes(kw, 32768, 2)
    assert two["activations"] * 2 == one["activations"]
    gib = 1024 ** 3
    assert one["total"] > 80 * gib > two["total"]
