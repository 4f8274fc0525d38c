"""Global batches of conversations and their split over data-parallel ranks.

Every rank walks the same seeded order of rows (a new permutation each epoch), loads the whole global batch
and keeps its own share, so the data position of a run is just ``(epoch, step in epoch)`` - which is what
makes resuming exact - and every rank can count the global batch's target tokens without communicating.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from verl.protocol import DataProto
from verl.utils.dataset.multiturn_sft_dataset import sft_collate_fn
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

__all__ = ["EpochOrder", "GlobalBatchSampler", "eval_batches", "global_target_tokens", "rows_to_dataproto",
           "split_for_rank"]


class EpochOrder:
    """The row order of each epoch: a permutation seeded by ``(seed, epoch)``, or 0..n-1 without shuffling."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        self.num_rows, self.seed, self.shuffle = num_rows, int(seed), shuffle

    def __call__(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()


class GlobalBatchSampler:
    """A batch sampler (for ``DataLoader(batch_sampler=...)``) over the global batches of one epoch, from
    ``start_step`` on; the last incomplete batch is dropped so every step has ``batch_size`` rows."""

    def __init__(self, order: EpochOrder, batch_size: int, epoch: int, start_step: int = 0):
        self.order, self.batch_size, self.epoch, self.start_step = order, batch_size, epoch, start_step

    def __len__(self) -> int:
        return max(0, self.order.num_rows // self.batch_size - self.start_step)

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.order(self.epoch)
        for step in range(self.start_step, self.order.num_rows // self.batch_size):
            yield idx[step * self.batch_size : (step + 1) * self.batch_size]


def _length(row: dict) -> int:
    return int(row["attention_mask"].sum())


def split_for_rank(rows: list[dict], dp_size: int, dp_rank: int, balance: bool) -> list[dict]:
    """This rank's rows of a global batch: equal counts, and with ``balance`` similar token totals."""
    if len(rows) % dp_size:
        raise ValueError(f"a global batch of {len(rows)} rows cannot be split evenly over {dp_size} ranks")
    if dp_size == 1:
        return rows
    if balance:
        parts = get_seqlen_balanced_partitions([_length(r) for r in rows], dp_size, equal_size=True)
        return [rows[i] for i in sorted(parts[dp_rank])]
    share = len(rows) // dp_size
    return rows[dp_rank * share : (dp_rank + 1) * share]


def rows_to_dataproto(rows: list[dict], pad_token_id: int, meta_info: Optional[dict] = None) -> DataProto:
    """Right-padded tensors (the engine data contract) plus per-row multimodal inputs."""
    batch = sft_collate_fn(rows, pad_token_id=pad_token_id)
    non_tensors = {}
    if "multi_modal_inputs" in batch:
        non_tensors["multi_modal_inputs"] = batch.pop("multi_modal_inputs")
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensors, meta_info=dict(meta_info or {}))


def eval_batches(num_rows: int, per_rank: int, dp_size: int, dp_rank: int) -> Iterator[tuple[list[int], list[bool]]]:
    """Validation: every row once. Yields this rank's row indices and whether each one counts; the last
    batch is topped up with repeats of row 0 that do not count, so all ranks run the same number of passes
    (the engine's collectives need that)."""
    step = per_rank * dp_size
    for start in range(0, num_rows, step):
        idx = list(range(start, min(start + step, num_rows)))
        counts = [True] * len(idx) + [False] * (step - len(idx))
        idx += [0] * (step - len(idx))
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        yield idx[mine], counts[mine]


def global_target_tokens(rows: list[dict]) -> int:
    """Target tokens of a batch as the loss counts them (a token at position 0 is never predicted)."""
    return int(sum(int(r["loss_mask"][1:].sum()) for r in rows))

