"""Balance variable-length sequences across ranks and micro-batches.

``get_seqlen_balanced_partitions`` splits items into k groups of near-equal
total load with the Karmarkar-Karp largest-differencing heuristic.
``rearrange_micro_batches`` uses it to build dynamic-size micro-batches that
respect a per-micro-batch token budget.
"""

from __future__ import annotations

import heapq
import itertools
from itertools import chain

import torch
from torch import distributed as dist

from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.utils.py_functional import CheckError


def calculate_workload(seqlen_list: torch.Tensor) -> torch.Tensor:
    """Relative cost of a sequence: linear (MLP/projections) plus quadratic (attention) terms.

    ~ 12*h^2*s + 2*h*s^2 FLOPs for hidden size h; with h=4096 and a common
    factor dropped this is ``24576*s + s^2``.
    """
    return 24576 * seqlen_list + seqlen_list**2


class _Bins:
    """k bins (sum, member indices), kept sorted by sum, largest first."""

    __slots__ = ("sums", "members")

    def __init__(self, sums: list[int], members: list[list[int]]):
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], -len(members[i]), members[i]))
        self.sums = [sums[i] for i in order]
        self.members = [members[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def combine(self, other: "_Bins") -> "_Bins":
        # Heaviest bin of one side joins the lightest of the other: differences cancel out.
        k = len(self.sums)
        return _Bins(
            [self.sums[i] + other.sums[k - 1 - i] for i in range(k)],
            [self.members[i] + other.members[k - 1 - i] for i in range(k)],
        )


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Largest-differencing partition of ``seqlen_list`` into ``k_partitions`` index groups.

    With ``equal_size`` every group gets ``len / k`` items: items are seeded k at
    a time (one per bin) and every combine step keeps bin counts equal.
    """
    order = sorted(range(len(seqlen_list)), key=lambda i: (seqlen_list[i], i))
    if equal_size:
        if len(seqlen_list) % k_partitions != 0:
            raise CheckError(f"{len(seqlen_list)} % {k_partitions} != 0: equal_size needs a divisible item count")
        seeds = [order[i : i + k_partitions] for i in range(0, len(order), k_partitions)]
    else:
        seeds = [[i] for i in order]
    heap, tie = [], itertools.count()
    for group in seeds:
        sums = [seqlen_list[i] for i in group] + [0] * (k_partitions - len(group))
        members = [[i] for i in group] + [[] for _ in range(k_partitions - len(group))]
        bins = _Bins(sums, members)
        # Pop the state with the largest spread first (then the one with the largest bin).
        heapq.heappush(heap, (-bins.spread, -bins.sums[0], next(tie), bins))
    while len(heap) > 1:
        first = heapq.heappop(heap)[-1]
        second = heapq.heappop(heap)[-1]
        merged = first.combine(second)
        heapq.heappush(heap, (-merged.spread, -merged.sums[0], next(tie), merged))
    return [list(m) for m in heap[0][-1].members] if heap else [[] for _ in range(k_partitions)]


def greedy_partition(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Assign items in order to the currently lightest bin (simple, less balanced than KK)."""
    # With equal_size a huge per-item bias makes "lightest" mean "fewest items" first.
    bias = sum(seqlen_list) + 1 if equal_size else 0
    bins: list[list[int]] = [[] for _ in range(k_partitions)]
    loads = [0] * k_partitions
    for idx, length in enumerate(seqlen_list):
        target = min(range(k_partitions), key=lambda j: (loads[j], j))
        bins[target].append(idx)
        loads[target] += length + bias
    if equal_size and any(len(b) * k_partitions != len(seqlen_list) for b in bins):
        raise CheckError(f"{len(seqlen_list)} items cannot be split into {k_partitions} equal-size partitions")
    return bins


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """``k_partitions`` non-empty, sorted index lists with balanced ``seqlen_list`` sums (Karmarkar-Karp)."""
    if k_partitions <= 0:
        raise CheckError(f"k_partitions must be positive, got {k_partitions}")
    if len(seqlen_list) < k_partitions:
        raise CheckError(
            f"number of items:[{len(seqlen_list)}] < k_partitions:[{k_partitions}]; every partition needs an item"
        )
    partitions = karmarkar_karp(list(seqlen_list), k_partitions, equal_size)
    covered = sorted(chain.from_iterable(partitions))
    if len(partitions) != k_partitions or covered != list(range(len(seqlen_list))):
        raise RuntimeError("internal error: partitions do not cover every item exactly once")
    for i, part in enumerate(partitions):
        if not part:
            raise CheckError(f"the {i}-th partition is empty")
    return [sorted(part) for part in partitions]


def log_seqlen_unbalance(seqlen_list: list[int], partitions: list[list[int]], prefix: str) -> dict:
    """Metrics comparing naive contiguous splitting with the balanced ``partitions``."""
    k = len(partitions)
    per_rank = max(1, len(seqlen_list) // k)
    naive = [sum(seqlen_list[i : i + per_rank]) for i in range(0, len(seqlen_list), per_rank)]
    balanced = [sum(seqlen_list[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": min(naive),
        f"{prefix}/max": max(naive),
        f"{prefix}/minmax_diff": max(naive) - min(naive),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(naive) / k,
    }


def ceildiv(a: int, b: int) -> int:
    """ceil(a / b) for integers."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """Smallest multiple of ``b`` that is >= ``a``."""
    return ceildiv(a, b) * b


def _effective_lengths(batch) -> tuple[torch.Tensor, int]:
    ids = batch.get("input_ids", None)
    if isinstance(ids, torch.Tensor) and ids.is_nested:
        lengths = ids.offsets().diff()
        return lengths, int(lengths.max())
    if "attention_mask" not in batch.keys():
        raise CheckError("rearrange_micro_batches needs 'attention_mask' (or jagged 'input_ids') in the batch")
    mask = batch["attention_mask"]
    return mask.sum(dim=-1), mask.shape[-1]


def _all_reduce(values: list[int], op, group) -> list[int]:
    t = torch.tensor(values, dtype=torch.long, device=get_device_name())
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.cpu().tolist()]


def _fitting_partitions(group_work, group_tokens, count: int, step: int, fewest_groups: int, max_token_len: int,
                        budget_key: str, sync_group) -> list[list[int]]:
    """Balanced partitions of the groups into ``count`` (then ``count + step`` ...) micro-batches until every one
    fits ``max_token_len``; with ``sync_group`` all ranks agree on the count."""
    while True:
        if count > fewest_groups:
            raise CheckError(
                f"Cannot satisfy max_token_len={max_token_len} ({budget_key}): needs {count} non-empty "
                f"micro-batches but a rank has only {fewest_groups} (groups of) sequences; raise {budget_key}."
            )
        parts = get_seqlen_balanced_partitions(group_work, count, equal_size=False)
        fits = all(sum(group_tokens[g] for g in part) <= max_token_len for part in parts)
        if sync_group is not None:
            fits = bool(_all_reduce([int(fits)], dist.ReduceOp.MIN, sync_group)[0])
        if fits:
            return parts
        count += step


def rearrange_micro_batches(
    batch,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
    budget_key: str = "ppo_max_token_len_per_gpu",
):
    """Split ``batch`` into micro-batches whose effective token count is <= ``max_token_len``.

    Effective tokens are ``attention_mask.sum()`` per row (or jagged ``input_ids`` lengths).
    The count of micro-batches starts at ``ceil(total / max_token_len)`` (at least
    ``min_num_micro_batch``, rounded up to a multiple of ``num_batches_divided_by``, and
    synchronised to the DP max when ``dp_group`` is given) and grows until a balanced
    partition fits the budget. ``force_group_size`` keeps consecutive rows together.
    With ``use_dynamic_bsz_balance`` the heaviest micro-batches go to the middle, which
    shortens pipeline warm-up/cool-down bubbles. ``budget_key`` is the config key the caller's budget comes
    from, named in the errors (the SFT trainer's is ``data.max_token_len_per_gpu``).

    Returns ``(micro_batches, index_lists)``; ``index_lists[i]`` are the original rows of micro-batch i.
    """
    if max_token_len <= 0:
        raise CheckError(f"max_token_len={max_token_len} ({budget_key}) must be positive")
    lengths, width = _effective_lengths(batch)
    n = len(lengths)
    if force_group_size <= 0 or n % force_group_size != 0:
        raise CheckError(f"Batch size {n} must be divisible by force_group_size {force_group_size}")
    num_groups = n // force_group_size
    lengths = lengths.long()
    sample_work = calculate_workload(lengths)
    group_work = sample_work.view(num_groups, force_group_size).sum(dim=1).cpu().tolist()
    group_tokens = lengths.view(num_groups, force_group_size).sum(dim=1).cpu().tolist()

    count = min(num_groups, ceildiv(int(lengths.sum()), max_token_len))
    if min_num_micro_batch is not None:
        count = max(count, min_num_micro_batch)
    sync = dist.is_available() and dist.is_initialized() and same_micro_num_in_dp and dp_group is not None
    largest_group, fewest_groups = max(group_tokens), num_groups
    if sync:
        count = _all_reduce([count], dist.ReduceOp.MAX, dp_group)[0]
        # Agree on fatal limits first so no rank raises while its peers wait in a collective.
        largest_group, neg_groups, width = _all_reduce([largest_group, -num_groups, width], dist.ReduceOp.MAX,
                                                       dp_group)
        fewest_groups = -neg_groups
    if max_token_len < width:
        raise CheckError(
            f"max_token_len must be greater than the sequence length. Got max_token_len={max_token_len} "
            f"({budget_key}) and a sequence length of {width}; raise {budget_key} to at least {width}"
        )
    if num_batches_divided_by is not None:
        count = roundup_divisible(count, num_batches_divided_by)
    if largest_group > max_token_len:
        raise CheckError(
            f"A forced group of {force_group_size} rows holds {largest_group} tokens, above max_token_len="
            f"{max_token_len} ({budget_key}); it cannot be split. Raise {budget_key} or lower force_group_size."
        )

    parts = _fitting_partitions(group_work, group_tokens, count, num_batches_divided_by or 1, fewest_groups,
                                max_token_len, budget_key, dp_group if sync else None)

    def part_work(part):
        return sum(group_work[g] for g in part)

    if use_dynamic_bsz_balance:
        parts.sort(key=lambda p: (part_work(p), p[0]), reverse=True)
        # Heaviest in the middle: light batches at both ends of the pipeline schedule.
        parts = parts[::2][::-1] + parts[1::2]
    index_lists = [[g * force_group_size + j for g in part for j in range(force_group_size)] for part in parts]
    micro_batches = [tu.index_select_tensor_dict(batch, idx) for idx in index_lists]
    return micro_batches, index_lists


def get_reverse_idx(idx_map) -> list[int]:
    """Inverse permutation: ``out[idx_map[i]] = i``."""
    idx_map = list(idx_map)
    reverse = [0] * len(idx_map)
    seen = set()
    for position, target in enumerate(idx_map):
        target = int(target)
        if not 0 <= target < len(idx_map) or target in seen:
            raise CheckError(f"idx_map must be a permutation of 0..{len(idx_map) - 1}; bad entry {target}")
        seen.add(target)
        reverse[target] = position
    return reverse


def prepare_dynamic_batch(
    data,
    max_token_len: int,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance: bool = True,
    budget_key: str = "ppo_max_token_len_per_gpu",
):
    """DataProto version of :func:`rearrange_micro_batches`: returns (list of DataProto, index lists)."""
    import copy

    make = type(data)  # a DataProto (built through its class: utils does not import verl.protocol)
    # Same option order as rearrange_micro_batches' positional parameters.
    micro_tds, index_lists = rearrange_micro_batches(
        data.batch, max_token_len, dp_group, num_batches_divided_by,
        same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, budget_key=budget_key,
    )  # fmt: skip
    micro_batches = []
    for td, rows in zip(micro_tds, index_lists, strict=True):
        non_tensors = {k: v[rows] for k, v in data.non_tensor_batch.items()}
        micro_batches.append(make(batch=td, non_tensor_batch=non_tensors, meta_info=copy.deepcopy(data.meta_info)))
    return micro_batches, index_lists


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: list[list[int]]) -> torch.Tensor:
    """Put rows produced in micro-batch order back into the original order."""
    order = list(chain.from_iterable(batch_idx_list))
    if len(order) != data.shape[0]:
        raise CheckError(f"index lists cover {len(order)} rows but data has {data.shape[0]}")
    inverse = torch.tensor(get_reverse_idx(order), dtype=torch.long)
    if data.is_nested:
        rows = tu.unbind_nested(data)
        return tu.nested_tensor_from_tensor_list([rows[i] for i in inverse.tolist()], ragged_idx=tu._ragged_dim(data))
    return data[inverse]


def get_group_balanced_partitions(seqlen_list: list[int], uid_list: list, k_partitions: int) -> list[list[int]]:
    """Balance across ``k_partitions`` while keeping consecutive rows with the same uid together.

    Each partition receives the same number of uid groups (equal-size KK over groups).
    """
    if len(seqlen_list) != len(uid_list):
        raise CheckError("seqlen_list and uid_list must have same length")
    groups: list[list[int]] = []
    for i, uid in enumerate(uid_list):
        if groups and uid_list[groups[-1][0]] == uid:
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) < k_partitions:
        raise CheckError(
            f"Number of uid groups ({len(groups)}) must be >= k_partitions ({k_partitions}). "
            "Reduce world size or increase the batch size."
        )
    workloads = [int(sum(24576 * seqlen_list[i] + seqlen_list[i] ** 2 for i in g)) for g in groups]
    parts = get_seqlen_balanced_partitions(workloads, k_partitions, equal_size=True)
    return [sorted(chain.from_iterable(groups[g] for g in part)) for part in parts]
