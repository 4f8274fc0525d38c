import itertools

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl import DataProto
from verl.utils import seqlen_balancing as sb


def _sums(values, parts):
    return [sum(values[i] for i in p) for p in parts]


def test_balanced_partitions_cover_and_balance():
    lens = [10, 9, 8, 7, 6, 5, 4, 3]
    parts = sb.get_seqlen_balanced_partitions(lens, 2, equal_size=False)
    assert sorted(itertools.chain(*parts)) == list(range(8))
    assert all(p == sorted(p) and p for p in parts)
    # total 52 splits perfectly into 26/26
    assert sorted(_sums(lens, parts)) == [26, 26]


def test_equal_size_partitions():
    lens = [100, 1, 1, 1, 50, 50]
    parts = sb.get_seqlen_balanced_partitions(lens, 3, equal_size=True)
    assert [len(p) for p in parts] == [2, 2, 2]
    # best equal-size split pairs 100 with a 1 and each 50 with a 1
    assert sorted(_sums(lens, parts)) == [51, 51, 101]
    with pytest.raises(ValueError, match="%"):
        sb.get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)


def test_partitions_non_empty_and_errors():
    parts = sb.get_seqlen_balanced_partitions([0, 0, 0, 0], 4, equal_size=False)
    assert sorted(len(p) for p in parts) == [1, 1, 1, 1]
    parts = sb.get_seqlen_balanced_partitions([1000, 1, 1], 3, equal_size=False)
    assert all(parts)
    with pytest.raises(ValueError, match="k_partitions"):
        sb.get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)


def test_greedy_partition_and_small_helpers():
    parts = sb.greedy_partition([5, 1, 1, 5], 2, equal_size=True)
    assert [len(p) for p in parts] == [2, 2]
    assert sb.ceildiv(7, 3) == 3 and sb.ceildiv(6, 3) == 2
    assert sb.roundup_divisible(7, 4) == 8 and sb.roundup_divisible(8, 4) == 8
    assert sb.calculate_workload(torch.tensor([2])).item() == 24576 * 2 + 4
    metrics = sb.log_seqlen_unbalance([4, 4, 1, 1], [[0, 2], [1, 3]], prefix="x")
    assert metrics["x/min"] == 2 and metrics["x/max"] == 8 and metrics["x/balanced_max"] == 5
    assert metrics["x/mean"] == 5


def _batch(lengths, width):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1  # left padded, like prompts
    ids = torch.arange(len(lengths))[:, None].expand(-1, width).clone()
    return TensorDict({"attention_mask": mask, "input_ids": ids}, batch_size=[len(lengths)])


@pytest.mark.parametrize("balance", [True, False])
def test_rearrange_micro_batches_budget_and_reverse(balance):
    lengths = [7, 3, 8, 2, 5, 6, 1, 8]
    batch = _batch(lengths, width=8)
    micro, idx = sb.rearrange_micro_batches(batch, max_token_len=10, use_dynamic_bsz_balance=balance)
    assert len(micro) == len(idx)
    # total 40 tokens -> at least 4 micro-batches
    assert len(micro) >= 4
    for mb, rows in zip(micro, idx, strict=True):
        assert int(mb["attention_mask"].sum()) <= 10
        assert mb["input_ids"][:, 0].tolist() == rows  # each micro batch holds exactly its rows
    flat = list(itertools.chain(*idx))
    assert sorted(flat) == list(range(8))
    # stitching outputs back in original order with the reverse index
    outputs = torch.cat([mb["input_ids"][:, 0] for mb in micro])
    restored = outputs[torch.tensor(sb.get_reverse_idx(flat))]
    assert restored.tolist() == list(range(8))
    assert sb.restore_dynamic_batch(outputs, idx).tolist() == list(range(8))


def test_rearrange_respects_min_and_divisor():
    batch = _batch([2, 2, 2, 2, 2, 2], width=4)
    micro, _ = sb.rearrange_micro_batches(batch, max_token_len=100, min_num_micro_batch=2)
    assert len(micro) == 2
    micro, _ = sb.rearrange_micro_batches(batch, max_token_len=5, num_batches_divided_by=4)
    assert len(micro) == 4  # ceil(12/5)=3 rounded up to a multiple of 4
    micro, idx = sb.rearrange_micro_batches(batch, max_token_len=8, force_group_size=2)
    assert all(len(rows) % 2 == 0 and rows[0] % 2 == 0 and rows[1] == rows[0] + 1 for rows in idx)


def test_rearrange_errors():
    batch = _batch([3, 9], width=9)
    with pytest.raises(ValueError, match="sequence length of 9"):
        sb.rearrange_micro_batches(batch, max_token_len=8)
    with pytest.raises(ValueError, match="force_group_size"):
        sb.rearrange_micro_batches(_batch([1, 1, 1], 2), max_token_len=8, force_group_size=2)


def test_rearrange_errors_name_the_callers_budget_key():
    """The budget's config key depends on the caller (RL actor, log-prob pass, SFT): the errors name the one
    given, and the RL actor's by default."""
    batch = _batch([3, 9], width=9)
    with pytest.raises(ValueError, match=r"raise ppo_max_token_len_per_gpu to at least 9"):
        sb.rearrange_micro_batches(batch, max_token_len=8)
    with pytest.raises(ValueError) as err:
        sb.rearrange_micro_batches(batch, max_token_len=8, budget_key="data.max_token_len_per_gpu")
    assert "raise data.max_token_len_per_gpu to at least 9" in str(err.value)
    assert "ppo_max_token_len_per_gpu" not in str(err.value)
    with pytest.raises(ValueError, match=r"data.max_token_len_per_gpu\) must be positive"):
        sb.rearrange_micro_batches(batch, max_token_len=0, budget_key="data.max_token_len_per_gpu")
    data = DataProto.from_dict(tensors=dict(batch.items()))
    with pytest.raises(ValueError, match="raise my.budget to at least 9"):
        sb.prepare_dynamic_batch(data, max_token_len=8, budget_key="my.budget")


def test_rearrange_nested_input_ids():
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in (4, 1, 3, 2)], layout=torch.jagged)
    batch = TensorDict({"input_ids": ids, "row": torch.arange(4)}, [4])
    micro, idx = sb.rearrange_micro_batches(batch, max_token_len=5)
    for mb, rows in zip(micro, idx, strict=True):
        assert mb["row"].tolist() == rows
        assert sum(t.numel() for t in mb["input_ids"].unbind()) <= 5


def test_reverse_idx_validation_and_prepare_dynamic_batch():
    assert sb.get_reverse_idx([2, 0, 1]) == [1, 2, 0]
    with pytest.raises(ValueError, match="permutation"):
        sb.get_reverse_idx([0, 0, 1])
    batch = _batch([4, 4, 1, 1], width=4)
    data = DataProto(batch=batch, non_tensor_batch={"uid": np.array(list("abcd"), dtype=object)}, meta_info={"k": 1})
    micro, idx = sb.prepare_dynamic_batch(data, max_token_len=5)
    for mb, rows in zip(micro, idx, strict=True):
        assert mb.non_tensor_batch["uid"].tolist() == [list("abcd")[r] for r in rows]
        assert mb.meta_info == {"k": 1}


def test_group_balanced_partitions_keep_uids_together():
    lens = [10, 10, 1, 1, 5, 5, 6, 6]
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    parts = sb.get_group_balanced_partitions(lens, uids, 2)
    for part in parts:
        groups = {uids[i] for i in part}
        assert all(sum(1 for i in part if uids[i] == g) == 2 for g in groups)
    assert sorted(len(p) for p in parts) == [4, 4]
    with pytest.raises(ValueError, match="uid groups"):
        sb.get_group_balanced_partitions([1, 1], ["a", "a"], 2)
