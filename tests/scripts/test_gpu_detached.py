"""scripts/gpu_detached.sh: a command in its own session, waited for across calls (a device call's 600 s limit)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_detached.sh"


def _sh(tmp_path, *args):
    env = dict(os.environ, DETACHED_DIR=str(tmp_path))
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_start_wait_reports_running_then_the_exit_code_and_only_new_lines(tmp_path):
    flag = tmp_path / "go"
    cmd = f"echo first; while [ ! -f {flag} ]; do sleep 0.2; done; echo second; exit 3"
    started = _sh(tmp_path, "start", "job", "bash", "-c", cmd)
    assert started.returncode == 0, started.stderr
    pid = int((tmp_path / "job.pid").read_text())
    assert os.getsid(pid) == pid  # a session of its own: what the device tool leaves running after a call
    running = _sh(tmp_path, "wait", "job", "1")
    assert running.returncode == 124 and "first" in running.stdout and "still running" in running.stdout
    assert _sh(tmp_path, "start", "job", "true").returncode == 1  # one at a time per name
    flag.touch()
    done = _sh(tmp_path, "wait", "job", "30")
    assert done.returncode == 3 and "second" in done.stdout and "first" not in done.stdout


def test_stop_ends_the_session_and_wait_says_so(tmp_path):
    assert _sh(tmp_path, "start", "long", "sleep", "300").returncode == 0
    pid = int((tmp_path / "long.pid").read_text())
    assert _sh(tmp_path, "stop", "long").returncode == 0
    assert _sh(tmp_path, "wait", "long", "1").returncode == 143
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        subprocess.run(["sleep", "0.1"])
    else:
        raise AssertionError("the detached session outlived stop")


def test_the_command_does_not_inherit_out(tmp_path):
    """The device tool's OUT is a folder it empties at every call: a command that outlives its call must not
    write its logs there (the 2026-11-28 launch lost one so)."""
    env = dict(os.environ, DETACHED_DIR=str(tmp_path), OUT=str(tmp_path / "call_out"), KEEP="kept")
    started = subprocess.run(["bash", str(SCRIPT), "start", "env", "bash", "-c", 'echo "OUT=${OUT:-unset} $KEEP"'],
                             env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    done = _sh(tmp_path, "wait", "env", "30")
    assert done.returncode == 0 and "OUT=unset kept" in done.stdout
