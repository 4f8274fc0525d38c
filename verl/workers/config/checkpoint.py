"""Checkpoint and profiler config dataclasses (upstream's names), generated from the YAML.

``CheckpointConfig`` is the ``checkpoint`` section of ``actor/actor.yaml``; ``McoreCheckpointConfig`` adds what
``actor/megatron_actor.yaml`` adds there (``mbridge_config``). ``ProfilerConfig`` is ``profiler/profiler.yaml``,
mounted as each role's ``profiler``.
"""

from __future__ import annotations

from verl.workers.config._generate import load_yaml, make_config, yaml_defaults

__all__ = ["CheckpointConfig", "McoreCheckpointConfig", "ProfilerConfig"]

_base = yaml_defaults(load_yaml("actor/actor.yaml").checkpoint)
_mcore = yaml_defaults(load_yaml("actor/megatron_actor.yaml").checkpoint)

CheckpointConfig = make_config("CheckpointConfig", _base, __name__,
                               "What a checkpoint saves and loads (actor.checkpoint.*).")
McoreCheckpointConfig = make_config("McoreCheckpointConfig", {k: v for k, v in _mcore.items() if k not in _base},
                                    __name__, "CheckpointConfig plus the Megatron actor's keys.",
                                    bases=(CheckpointConfig,))
ProfilerConfig = make_config("ProfilerConfig", yaml_defaults(load_yaml("profiler/profiler.yaml")), __name__,
                             "Per-role profiling (actor.profiler.*).")
