"""``fsdp_param_groups`` reads FSDP2's parameter groups on both torch layouts: a list (``_fsdp_param_groups``,
torch >= 2.12, this CPU wheel) and one optional group (``_fsdp_param_group``, torch 2.11 on the GPU image, where
the asynchronous modes' weight install failed on 2026-11-27 before this helper)."""

from types import SimpleNamespace

import pytest

from verl.utils.fsdp_utils import fsdp_param_groups


def test_this_torch_state_is_read():
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    state = FSDPState()
    assert fsdp_param_groups(state) == []
    marker = object()
    if hasattr(state, "_fsdp_param_groups"):
        state._fsdp_param_groups.append(marker)
    else:  # pragma: no cover - an older torch
        state._fsdp_param_group = marker
    assert fsdp_param_groups(state) == [marker]


@pytest.mark.parametrize("group", [None, "g"])
def test_single_group_layout(group):
    state = SimpleNamespace(_fsdp_param_group=group)
    assert fsdp_param_groups(state) == ([] if group is None else ["g"])


def test_list_layout_wins_and_is_copied():
    groups = ["a", "b"]
    state = SimpleNamespace(_fsdp_param_groups=groups, _fsdp_param_group="ignored")
    out = fsdp_param_groups(state)
    assert out == ["a", "b"] and out is not groups


def test_unknown_layout_names_the_attribute():
    with pytest.raises(AttributeError, match="_fsdp_param_group"):
        fsdp_param_groups(SimpleNamespace())
