"""On-policy distillation (upstream verl's ``distillation.*``): a teacher model scores the student's own
rollouts, and the student is trained towards it with a per-token reverse-KL estimate on the sampled tokens,
alone or added to the RL loss. See ``docs/advance/distillation.md``."""

from .losses import (  # noqa: F401
    distillation_loss,
    distillation_loss_config,
    is_distillation_enabled,
    teacher_model_config,
)
