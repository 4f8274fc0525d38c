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


class ConsoleLogger:
    def log(self, data: dict, step: int) -> None:
        parts = []
        for k, v in data.items():
            v = _plain(v)
            parts.append(f"{k}:{v:.3f}" if isinstance(v, float) else f"{k}:{v}")
        print(f"step:{step} - " + " - ".join(parts), flush=True)

    def finish(self):
        pass


class FileLogger:
    """JSON lines ``{"step": N, "data": {...}}`` at $VERL_FILE_LOGGER_PATH, else <root>/<project>/<experiment>.jsonl."""

    def __init__(self, project_name: str, experiment_name: str):
        path = os.getenv("VERL_FILE_LOGGER_PATH")
        if not path:
            root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
            path = os.path.join(root, project_name, f"{experiment_name}.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        # Append: a resumed run continues the same log.
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
    def __init__(self, project_name: str, experiment_name: str, default_backend="console", config: Any = None):
        backends = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        self.loggers = {}
        for b in backends:
            if b not in SUPPORTED:
                raise ValueError(f"trainer.logger contains {b!r}; supported loggers are {list(SUPPORTED)}")
            if b == "console":
                self.loggers[b] = ConsoleLogger()
            elif b == "file":
                self.loggers[b] = FileLogger(project_name, experiment_name)
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
