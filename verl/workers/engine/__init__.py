"""Training engines behind one interface (see :mod:`verl.workers.engine.base`)."""

from .base import BaseEngine, EngineRegistry, LossFn, accumulate_metrics, response_slice

EngineRegistry.register("fsdp2", "verl.workers.engine.fsdp.FSDPEngine")
EngineRegistry.register("megatron", "verl.workers.engine.megatron.MegatronEngine")

__all__ = ["BaseEngine", "EngineRegistry", "LossFn", "accumulate_metrics", "response_slice"]
