"""Profiling through upstream's keys (``global_profiler.*``, ``<role>.profiler.*``) with tool=torch.

* :mod:`.config`: reading and checking the keys (validation calls :func:`check_profiler_config`);
* :mod:`.trainer_hook`: :class:`StepProfiler`, the trainer's ``with profiler.step(n):``;
* :mod:`verl.single_controller.profiler_worker`: the ``start_profile`` / ``stop_profile`` methods every worker has;
* :mod:`.torch_profile`: the torch.profiler recorder that writes Chrome traces under the save path.
"""

from .config import ProfilePlan, check_profiler_config
from .trainer_hook import StepProfiler

__all__ = ["ProfilePlan", "StepProfiler", "check_profiler_config"]
