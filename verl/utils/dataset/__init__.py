"""Datasets for RL post-training."""

from .rl_dataset import RLHFDataset, collate_fn, create_rl_dataset, create_rl_sampler, get_dataset_class

__all__ = ["RLHFDataset", "collate_fn", "create_rl_dataset", "create_rl_sampler", "get_dataset_class"]
