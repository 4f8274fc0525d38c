"""Training engines behind one interface (see :mod:`verl.workers.engine.base`)."""

from .base import BaseEngine, EngineRegistry, LossFn, accumulate_metrics, response_slice
from .megatron.layout import megatron_dp_layout
from .sections import ENGINE_SECTIONS, EngineSections

# One registration per engine: its class, and where its settings live in a role section.
EngineRegistry.register("fsdp2", "verl.workers.engine.fsdp.FSDPEngine")
ENGINE_SECTIONS.register("fsdp2", EngineSections(engine_keys=("fsdp_config", "fsdp", "model.fsdp_config"),
                                                 replica_keys=("ulysses_sequence_parallel_size",)))
EngineRegistry.register("megatron", "verl.workers.engine.megatron.MegatronEngine")
ENGINE_SECTIONS.register("megatron", EngineSections(
    engine_keys=("megatron",),
    replica_keys=tuple(f"megatron.{k}_parallel_size" for k in ("tensor_model", "pipeline_model", "context")),
    dp_layout=lambda world, sizes: megatron_dp_layout(world, tp=sizes[0], pp=sizes[1], cp=sizes[2])))

__all__ = ["BaseEngine", "ENGINE_SECTIONS", "EngineRegistry", "EngineSections", "LossFn", "accumulate_metrics",
           "response_slice"]
