"""A discriminative reward model as the training engines see it: the backbone of a ``*ForSequenceClassification``
checkpoint with its trained score head applied at every position.

Hugging Face's sequence-classification forward pools the head's output at the last non-pad token of each row,
which needs padded rows. The engines pack sequences (remove padding), so the head runs on every token here and
the worker reads the score at each sequence's last token: the same number for the same token sequence.
"""

from __future__ import annotations

import torch

from verl.models.backbone_head import BackboneWithHead


def load_score_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False,
                     where: str = "reward.reward_model.model_path") -> "ScoreModel":
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{where}={path!r} is a {archs or 'checkpoint without architectures'}, not a sequence-classification "
            "model: a discriminative reward model is a *ForSequenceClassification checkpoint (a score head over the "
            "backbone). A generative judge (a causal LM) is used with reward.custom_reward_function.path set.")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return ScoreModel(model).to(dtype)


class ScoreModel(BackboneWithHead):
    head_name = "score"

    def __init__(self, seq_cls: torch.nn.Module):
        prefix = getattr(seq_cls, "base_model_prefix", "model") or "model"
        super().__init__(seq_cls.config, getattr(seq_cls, prefix), getattr(seq_cls, "_no_split_modules", None))
        self.score = seq_cls.score

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        # The last label is the score, as upstream reads a classify endpoint's last output.
        return self.head_outputs(input_ids, attention_mask, position_ids, **kwargs)[..., -1]
