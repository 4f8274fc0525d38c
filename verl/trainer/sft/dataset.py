"""The SFT dataset a config asks for (importable as ``verl.trainer.sft_trainer.create_sft_dataset``, its upstream
name): the trainer builds it here, so the trainer does not import its own entry point."""

from __future__ import annotations

__all__ = ["create_sft_dataset"]


def create_sft_dataset(data_paths, data_config, tokenizer, processor, max_samples: int = -1):
    """``data.custom_cls`` when set, else :class:`MultiTurnSFTDataset`."""
    from torch.utils.data import Dataset

    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset
    from verl.utils.dataset.rl_dataset import _load_object_from_path

    custom = data_config.get("custom_cls")
    cls = MultiTurnSFTDataset
    if custom is not None and custom.get("path"):
        if not custom.get("name"):
            raise ValueError("data.custom_cls.path is set but data.custom_cls.name is empty; name the dataset class")
        cls = _load_object_from_path(custom.path, custom.name, "data.custom_cls")
        if not (isinstance(cls, type) and issubclass(cls, Dataset)):
            raise TypeError(f"data.custom_cls: {custom.name!r} must be a torch.utils.data.Dataset subclass")
    return cls(data_paths, tokenizer, data_config, processor=processor, max_samples=max_samples)
