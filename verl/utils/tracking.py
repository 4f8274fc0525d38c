"""Experiment tracking: one ``Tracking.log(data, step)`` fanned out to console, file, tensorboard and wandb."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED = ("console", "file", "tensorboard", "wandb")


def _plain(v: Any):
    try:
        import numpy as np
        import torch

        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
    except ImportError:  # pragma: no cover
        pass
    return v


# The console shows one short line per step; the file / tensorboard / wandb loggers get every metric.
# VERL_CONSOLE_METRICS adds metrics to that line: comma-separated keys or shell patterns
# (`actor/entropy,perf/*`), or `all` for every metric (the long line). An environment variable, not a
# trainer.* key: upstream's config has no such key, and this project adds none of its own there.
CONSOLE_METRICS_ENV = "VERL_CONSOLE_METRICS"

# (label, candidate keys): the first key present is shown - the RL trainer's, then the SFT trainer's.
_HEADLINE = (
    ("score", ("critic/score/mean",)),
    ("loss", ("actor/pg_loss", "train/loss")),
    ("val loss", ("val/loss",)),
)
_STEP_TIME = ("timing_s/step", "train/step_time(s)")


def _fmt(v) -> str:
    v = _plain(v)
    if isinstance(v, float):
        if not math.isfinite(v) or v == 0 or 1e-3 <= abs(v) < 100:
            return f"{v:.3f}"
        if abs(v) < 1e-3:
            return f"{v:.1e}"  # a tiny loss stays visible (and keeps its sign)
        return f"{v:.1f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)


def _watched(data: dict, spec: str) -> list[str]:
    import fnmatch

    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    return [k for k in data if any(fnmatch.fnmatchcase(k, p) for p in patterns)]


def console_line(data: dict, step: int, watch: str = "") -> str:
    """``step N | score S | loss L | T s/step | val <source> V | <watched metrics>``, leaving out what a step
    did not log (a validation-only step shows only its validation scores)."""
    if watch.strip().lower() == "all":
        return f"step:{step} - " + " - ".join(f"{k}:{_fmt(v)}" for k, v in data.items())
    parts = [f"step {step}"]
    shown = set()
    for label, keys in _HEADLINE:
        key = next((k for k in keys if k in data), None)
        if key is not None:
            parts.append(f"{label} {_fmt(data[key])}")
            shown.add(key)
    key = next((k for k in _STEP_TIME if k in data), None)
    if key is not None:
        parts.append(f"{_plain(data[key]):.2f} s/step")
        shown.add(key)
    # Greedy validation scores per data source: val-core/<source>/<reward key>/mean@1.
    for key in data:
        if key.startswith("val-core/") and key.endswith("/mean@1"):
            parts.append(f"val {key.split('/')[1]} {_fmt(data[key])}")
            shown.add(key)
    parts += [f"{k} {_fmt(data[k])}" for k in _watched(data, watch) if k not in shown]
    return " | ".join(parts)


class ConsoleLogger:
    def __init__(self, watch: str | None = None):
        self.watch = os.getenv(CONSOLE_METRICS_ENV, "") if watch is None else watch

    def log(self, data: dict, step: int) -> None:
        print(console_line(data, step, self.watch), flush=True)

    def finish(self):
        pass


def new_run_dir(base: str) -> str:
    """A fresh ``<base>/runs/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when two runs start in one second): one
    run's plots and metric log, never overwritten or appended to by a later run."""
    import time

    root = os.path.join(os.path.abspath(os.path.expanduser(base)), "runs")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(root, exist_ok=True)
    for n in range(1, 1000):
        path = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory under {root}")


class FileLogger:
    """JSON lines ``{"step": N, "data": {...}}``. Where: $VERL_FILE_LOGGER_PATH, else (upstream's layout)
    $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl, else ``<run_dir>/metrics.jsonl`` when the trainer
    gives a run directory, else ./<project>/<experiment>.jsonl. The upstream paths are appended to (a resumed
    run continues the same log); a run directory's log holds one run."""

    def __init__(self, project_name: str, experiment_name: str, run_dir: str | None = None):
        path = os.getenv("VERL_FILE_LOGGER_PATH")
        if not path:
            root = os.getenv("VERL_FILE_LOGGER_ROOT")
            if root is None and run_dir is not None:
                path = os.path.join(run_dir, "metrics.jsonl")
            else:
                path = os.path.join(os.path.expanduser(root or "."), project_name, f"{experiment_name}.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.fp = open(path, "a", buffering=1)

    def log(self, data: dict, step: int) -> None:
        clean = {}
        for k, v in data.items():
            v = _plain(v)
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)
            clean[k] = v
        self.fp.write(json.dumps({"step": step, "data": clean}) + "\n")

    def finish(self):
        self.fp.close()


class TensorboardLogger:
    def __init__(self, project_name: str, experiment_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("trainer.logger contains 'tensorboard' but tensorboard is not installed: "
                              "pip install -e .[tensorboard]") from e
        d = os.getenv("TENSORBOARD_DIR", os.path.join("tensorboard_log", project_name, experiment_name))
        self.writer = SummaryWriter(d)

    def log(self, data: dict, step: int) -> None:
        for k, v in data.items():
            v = _plain(v)
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def finish(self):
        self.writer.close()


class WandbLogger:
    def __init__(self, project_name: str, experiment_name: str, config: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("trainer.logger contains 'wandb' but wandb is not installed: pip install -e .[wandb]") from e
        self.wandb = wandb
        wandb.init(project=project_name, name=experiment_name, config=config)

    def log(self, data: dict, step: int) -> None:
        self.wandb.log({k: _plain(v) for k, v in data.items()}, step=step)

    def finish(self):
        self.wandb.finish()


class Tracking:
    """``run_dir`` (this project's trainers pass one, see :func:`new_run_dir`) is where the file logger writes
    unless upstream's VERL_FILE_LOGGER_* variables say otherwise."""

    def __init__(self, project_name: str, experiment_name: str, default_backend="console", config: Any = None,
                 run_dir: str | None = None):
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        self.run_dir = run_dir
        self.loggers = {}
        for b in backends:
            if b not in SUPPORTED:
                raise ValueError(f"trainer.logger contains {b!r}; supported loggers are {list(SUPPORTED)}")
            if b == "console":
                self.loggers[b] = ConsoleLogger()
            elif b == "file":
                self.loggers[b] = FileLogger(project_name, experiment_name, run_dir)
            elif b == "tensorboard":
                self.loggers[b] = TensorboardLogger(project_name, experiment_name)
            elif b == "wandb":
                self.loggers[b] = WandbLogger(project_name, experiment_name, config)

    def log(self, data: dict, step: int, backend=None) -> None:
        for name, lg in self.loggers.items():
            if backend is None or name in backend:
                lg.log(data, step)

    def finish(self):
        for lg in self.loggers.values():
            lg.finish()


def announce_run_dir(tracker: Tracking, plot_name: str) -> None:
    """One line saying where this run's outputs go (the README points users at it)."""
    outputs = [plot_name + " at the end"]
    if "file" in tracker.loggers:
        outputs.insert(0, f"metrics -> {tracker.loggers['file'].path}")
    print(f"Run directory: {tracker.run_dir} ({'; '.join(outputs)})", flush=True)
