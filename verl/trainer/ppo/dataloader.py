"""A resumable batch loader: the order of every epoch is a pure function of (seed, epoch).

Its state is just (epoch, batches consumed), so a resumed run draws exactly the batches the original
run would have drawn next, without replaying data or depending on worker processes.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch


class StepDataLoader:
    def __init__(self, dataset, batch_size: int, collate_fn: Callable, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # batches already yielded in the current epoch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def epoch_iter(self, epoch: int, start: int = 0) -> Iterator[dict]:
        order = self._order(epoch)
        for b in range(start, len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.collate_fn([self.dataset[i] for i in idx])

    def __iter__(self) -> Iterator[dict]:
        """Continue the current epoch from where it stopped, then move to the next epoch."""
        for batch in self.epoch_iter(self.epoch, self.consumed):
            self.consumed += 1
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.seed = int(state.get("seed", self.seed))
