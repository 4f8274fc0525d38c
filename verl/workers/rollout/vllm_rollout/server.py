"""Server mode: the vLLM engine in its own process, updated by the trainer over a collective.

Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend`` = ``nccl`` (CUDA), ``hccl`` (Ascend) or
``gloo`` (CPU hosts); ``naive`` (the default) keeps the engine inside the trainer process.

Control messages (small, picklable) travel over a ``multiprocessing`` pipe; tensors travel over a standalone
two-rank process group (:class:`verl.utils.vllm.broadcast.PairCommunicator`) on the trainer's device, the
trainer being rank 0; the server allocates every receive buffer on that same device. Full-weight and LoRA
updates are separate commands on both sides:

* ``update_weights``: bucketed full reload through the engine's checkpoint loader, coverage-checked; the
  engine is built ``standalone``, so on vLLM-Ascend the reload goes through the checkpoint layout and MoE
  post-load processing runs again after it (:meth:`vLLMRollout.update_weights`).
* ``update_lora``: adapter tensors only; written as an adapter directory, never post-processed.

:class:`vLLMServerClient` implements :class:`~verl.workers.rollout.base.BaseRollout`, so the trainer
drives a server exactly like a colocated engine.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Iterable, Optional

import torch

from verl.utils.vllm.broadcast import PairCommunicator, broadcast_tensor
from verl.workers.rollout.base import BaseRollout, GenerationOutput, GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)}
_ENGINE = "verl.workers.rollout.vllm_rollout.vllm_rollout.vLLMRollout"


def _load(qualname: str):
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _receive(comm: PairCommunicator, meta: list[tuple[str, tuple, str]]):
    """Server side of one bucket: allocate, receive every tensor in order, then yield them."""
    out = []
    for name, shape, dtype in meta:
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=comm.device)
        broadcast_tensor(comm, t, src=0)
        out.append((name, t))
    return out


def _server_main(conn, engine_cls: str, config: dict, model_config: dict, comm_info: dict, env: dict) -> None:
    os.environ.update(env)
    from omegaconf import OmegaConf

    try:
        device = comm_info.get("device")
        if device is not None:
            # The engine and the receive buffers live on the server's device (the trainer's, except for NCCL).
            dev = torch.device(device)
            if dev.type == "npu":
                import torch_npu  # noqa: F401  (registers torch.npu in this fresh process)
            getattr(torch, dev.type).set_device(dev)
        # A spawned process has none of the trainer's imports: model.external_lib registers custom models
        # (transformers Auto classes, rollout weight loaders) before the engine is built and looks them up.
        from verl.workers.engine.external_lib import import_external_lib

        import_external_lib(model_config)
        engine = _load(engine_cls)(OmegaConf.create(config), OmegaConf.create(model_config), tokenizer=None,
                                   standalone=True)
    except Exception:  # report start-up failures instead of leaving the client waiting
        conn.send(("error", traceback.format_exc()))
        return
    # "ready" before the collective: the client joins the two-rank group only once the engine exists (a
    # client that joined first would wait forever for a server whose engine failed to build).
    conn.send(("ready", None))
    store = torch.distributed.FileStore(comm_info["store_path"], 2)
    comm = PairCommunicator(comm_info["backend"], store, rank=1, world_size=2, device=device)
    while True:
        cmd, payload = conn.recv()
        try:
            if cmd == "shutdown":
                if hasattr(engine, "shutdown"):
                    engine.shutdown()
                conn.send(("ok", None))
                return
            conn.send(("ok", _handle(engine, comm, conn, cmd, payload)))
        except Exception as e:  # the error travels back with its traceback; the server keeps serving
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _handle(engine, comm, conn, cmd: str, payload: Any):
    if cmd == "generate":
        requests, params = payload
        return engine.generate(requests, params)
    if cmd == "score":
        return engine.score(payload)
    if cmd == "update_weights":
        # Buckets arrive one at a time while the engine's loader consumes the stream: the server holds one
        # bucket, the trainer gathers one bucket. A ("bucket", meta) message precedes each bucket's tensors.
        def stream():
            while True:
                kind, meta = conn.recv()
                if kind == "end":
                    return
                yield from _receive(comm, meta)

        engine.update_weights(stream())
        return None
    if cmd == "update_lora":
        tensors = _receive(comm, payload["meta"])
        engine.update_weights(tensors, lora=payload["lora"])
        return None
    if cmd in ("sleep", "wake_up"):
        getattr(engine, cmd)(tuple(payload))
        return bool(getattr(engine, "weights_lost_in_sleep", False))
    raise ValueError(f"unknown server command {cmd!r}")


SERVER_DEVICE_ENV = "VERL_ROLLOUT_SERVER_DEVICE"


def server_device(backend: str, trainer_device: Optional[torch.device], requested: Optional[str]):
    """The device the rollout server's engine and receive buffers live on.

    By default the trainer's own device. NCCL refuses two processes on one GPU ("Duplicate GPU detected"), so
    ``backend=nccl`` needs the server on another GPU of this host, named by ``VERL_ROLLOUT_SERVER_DEVICE``
    (e.g. ``cuda:1``); without it the start is refused here, with what to do, instead of failing inside NCCL.
    """
    if requested:
        dev = torch.device(requested)
        if trainer_device is None or dev.type != trainer_device.type:
            raise ValueError(f"{SERVER_DEVICE_ENV}={requested} must be a {getattr(trainer_device, 'type', 'cpu')} "
                             f"device like the trainer's (checkpoint_engine.backend={backend})")
        if dev.index is None:
            dev = torch.device(dev.type, 0)
        return dev
    if backend == "nccl" and trainer_device is not None:
        raise ValueError(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend=nccl connects the trainer and a rollout server "
            f"process over NCCL, which refuses two processes on one GPU ({trainer_device} would hold both). Put the "
            f"server on another GPU of this host with {SERVER_DEVICE_ENV}=cuda:N, or use backend=naive to run the "
            f"engine inside the trainer process on the same GPU")
    return trainer_device


def _physical_cuda_device(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's ``cuda:index``."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[index] if visible else str(index)


class vLLMServerClient(BaseRollout):
    """Trainer-side handle of a rollout server process (``rollout.checkpoint_engine.backend=nccl|hccl|gloo``)."""

    def __init__(
        self,
        config,
        model_config,
        tokenizer=None,
        module=None,
        processor=None,
        *,
        backend: Optional[str] = None,
        engine_cls: str = _ENGINE,
        start_timeout: float = 600.0,
    ):
        from omegaconf import OmegaConf

        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device

        self.config = config
        self.bucket_megabytes = _bucket_mb(config)
        self.backend = backend or get_nccl_backend()  # nccl on CUDA, hccl on Ascend, gloo on CPU
        name = get_device_name()
        # Tensors cross on the device the collective runs on: the trainer's current accelerator, CPU for gloo.
        self.device = torch.device(name, get_torch_device().current_device()) if self.backend != "gloo" else None
        self.server_device = server_device(self.backend, self.device, os.environ.get(SERVER_DEVICE_ENV))
        self._tmp = tempfile.mkdtemp(prefix="verl_vllm_server_")
        store_path = os.path.join(self._tmp, "store")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        to_plain = (lambda c: OmegaConf.to_container(c, resolve=True) if OmegaConf.is_config(c) else dict(c))
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ASCEND_ENABLE_NZ"):
            if key in os.environ:
                env[key] = os.environ[key]
        child_device = self.server_device
        if child_device is not None and child_device.type == "cuda" and child_device != self.device:
            # vLLM builds on the first visible GPU of its process: show the server only its own GPU.
            env["CUDA_VISIBLE_DEVICES"] = _physical_cuda_device(child_device.index)
            child_device = torch.device("cuda", 0)
        info = {"store_path": store_path, "backend": self.backend,
                "device": str(child_device) if child_device is not None else None}
        self._proc = ctx.Process(
            target=_server_main,
            args=(child, engine_cls, to_plain(config), to_plain(model_config), info, env),
            daemon=True,
        )
        self._proc.start()
        if not self._conn.poll(start_timeout):
            self._proc.terminate()
            raise TimeoutError(f"rollout server did not build its engine within {start_timeout:.0f}s")
        status, detail = self._conn.recv()
        if status != "ready":
            self._proc.join(timeout=60)
            self._proc = None
            raise RuntimeError(f"rollout server failed to start:\n{detail}")
        store = torch.distributed.FileStore(store_path, 2)
        self._comm = PairCommunicator(self.backend, store, rank=0, world_size=2, device=self.device)

    def _call(self, cmd: str, payload: Any = None):
        self._conn.send((cmd, payload))
        return self._reply()

    def _reply(self):
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"rollout server error: {value}")
        return value

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[list[GenerationOutput]]:
        return self._call("generate", (requests, params))

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._call("score", sequences)

    def _send(self, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        if self.device is not None:
            t = t.to(self.device)
        broadcast_tensor(self._comm, t, src=0)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs) -> None:
        """Full weights (or, with ``lora=...``, adapter tensors) to the server over the collective."""
        lora = kwargs.get("lora")
        pairs = list(weights) if lora else None
        if lora:
            meta = [(n, tuple(t.shape), str(t.dtype)) for n, t in pairs]
            self._conn.send(("update_lora", {"meta": meta, "lora": lora}))
            for _, t in pairs:
                self._send(t)
            self._reply()
            return
        self._conn.send(("update_weights", None))
        bucket, size, limit = [], 0, self.bucket_megabytes << 20
        try:
            for name, t in weights:
                nbytes = t.numel() * t.element_size()
                if bucket and size + nbytes > limit:
                    self._flush(bucket)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += nbytes
            if bucket:
                self._flush(bucket)
        finally:
            self._conn.send(("end", None))  # the server's loader stops; coverage is checked there
        self._reply()
        self.weights_lost_in_sleep = False

    def _flush(self, bucket) -> None:
        self._conn.send(("bucket", [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket]))
        for _, t in bucket:
            self._send(t)

    weights_lost_in_sleep = False  # the server engine's answer after the last sleep / wake-up

    def sleep(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        self.weights_lost_in_sleep = self._call("sleep", list(tags))

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        self.weights_lost_in_sleep = self._call("wake_up", list(tags))

    def shutdown(self) -> None:
        if getattr(self, "_proc", None) is None:
            return
        try:
            if self._proc.is_alive():
                self._call("shutdown")
        finally:
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc = None


def _bucket_mb(config) -> int:
    from .engine_args import bucket_megabytes

    return bucket_megabytes(config)
