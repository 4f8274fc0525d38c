import pickle

import pytest
import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu

LENS = [2, 4, 3, 5]


def mrope_samples(channels=3, lens=LENS):
    # per-sample (channels, L_i) position ids, distinct values per sample
    return [torch.arange(channels * n).view(channels, n) + 100 * i for i, n in enumerate(lens)]


def mrope_nested(channels=3, lens=LENS):
    return tu.nested_tensor_from_tensor_list(mrope_samples(channels, lens), ragged_idx=2)


def make_batch():
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in LENS], layout=torch.jagged)
    return tu.get_tensordict(
        {"input_ids": ids, "position_ids": mrope_nested(), "score": torch.arange(4.0), "tag": ["a", "b", "c", "d"]},
        non_tensor_dict={"temperature": 0.6},
    )


def test_nested_from_list_keeps_ragged_dim_even_for_equal_lengths():
    nt = tu.nested_tensor_from_tensor_list([torch.zeros(3, 4), torch.ones(3, 4)], ragged_idx=2)
    assert nt.shape[1] == 3 and nt._ragged_idx == 2
    padded = mrope_nested().to_padded_tensor(-1)
    assert padded.shape == (4, 3, 5)  # padded to the longest sample (5), not truncated
    assert padded[0, :, 2:].eq(-1).all()
    with pytest.raises(ValueError, match="ragged_idx"):
        tu.nested_tensor_from_tensor_list([torch.zeros(3, 4)], ragged_idx=3)


@pytest.mark.parametrize("channels", [3, 4])
def test_chunk_tensordict_with_3d_jagged_position_ids(channels):
    samples = mrope_samples(channels)
    td = TensorDict({"position_ids": tu.nested_tensor_from_tensor_list(samples, 2), "x": torch.arange(4)}, [4])
    parts = tu.chunk_tensordict(td, 2)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3]]
    got = [t for p in parts for t in p["position_ids"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(got, samples, strict=True))
    assert all(p["position_ids"].shape[1] == channels for p in parts)


def test_chunk_tensordict_ragged_middle_dim():
    # (B, j, 3) layout: ragged dim first, fixed trailing dim
    samples = [torch.arange(n * 3).view(n, 3) for n in LENS]
    nt = torch.nested.as_nested_tensor(samples, layout=torch.jagged)
    parts = tu.chunk_tensordict(TensorDict({"p": nt}, [4]), 4)
    assert [p["p"].unbind()[0].shape for p in parts] == [(n, 3) for n in LENS]


def test_chunk_tensordict_falls_back_to_padding_when_unbind_fails(monkeypatch):
    td = make_batch()
    # A consolidate+pickle round trip (how DataProto ships batches) drops the cached max
    # length, so a naive to_padded_tensor would pad to width 3 and truncate samples;
    # the fallback must still recover every sample exactly.
    td = pickle.loads(pickle.dumps(td.consolidate()))
    nested_cls = type(td["position_ids"])

    def broken_unbind(self, dim=0):
        raise RuntimeError("split_with_sizes expects split_sizes to sum exactly")

    monkeypatch.setattr(nested_cls, "unbind", broken_unbind)
    parts = tu.chunk_tensordict(td, 2)
    monkeypatch.undo()
    expected = mrope_samples()
    got = [t for p in parts for t in p["position_ids"].unbind()]
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert [t.tolist() for t in parts[1]["input_ids"].unbind()] == [list(range(3)), list(range(5))]
    assert tu.get(parts[0], "tag") == ["a", "b"] and tu.get(parts[1], "temperature") == 0.6


def test_chunk_errors():
    with pytest.raises(ValueError, match="divisible"):
        tu.chunk_tensordict(make_batch(), 3)
    with pytest.raises(ValueError, match="TensorDict"):
        tu.chunk_tensordict({"a": torch.zeros(2)}, 1)


def test_concat_round_trip_and_meta_kept():
    td = make_batch()
    parts = tu.chunk_tensordict(td, 2)
    back = tu.concat_tensordict(parts)
    tu.assert_tensordict_eq(back, td)
    assert tu.get(back, "temperature") == 0.6
    with pytest.raises(ValueError, match="same set of nested"):
        tu.concat_tensordict([parts[0], TensorDict({"score": torch.zeros(2)}, [2])])


def test_index_select_and_union():
    td = make_batch()
    picked = tu.index_select_tensor_dict(td, [3, 0])
    assert picked["score"].tolist() == [3.0, 0.0]
    assert torch.equal(picked["position_ids"].unbind()[0], mrope_samples()[3])
    assert tu.get(picked, "tag") == ["d", "a"]
    assert tu.index_select_tensor_dict(None, [0]) is None
    with pytest.raises(ValueError, match="1D"):
        tu.index_select_tensor_dict(td, torch.zeros(2, 2, dtype=torch.long))
    a = TensorDict({"x": torch.arange(2)}, [2])
    merged = tu.union_tensor_dict(a, TensorDict({"x": torch.arange(2), "y": torch.ones(2)}, [2]))
    assert set(merged.keys()) == {"x", "y"}
    with pytest.raises(ValueError, match="x in tensor_dict1"):
        tu.union_tensor_dict(a, TensorDict({"x": torch.tensor([5, 5])}, [2]))


def test_get_pop_keys_and_assign():
    td = make_batch()
    assert tu.get(td, "missing", "dflt") == "dflt"
    sub = tu.get_keys(td, ["score", "temperature"])
    assert set(sub.keys()) == {"score", "temperature"} and tu.get(sub, "temperature") == 0.6
    with pytest.raises(KeyError):
        tu.get_keys(td, ["nope"])
    popped = tu.pop_keys(td, ["tag"])
    assert "tag" not in td.keys() and tu.get(popped, "tag") == ["a", "b", "c", "d"]
    assert tu.pop(td, "temperature") == 0.6 and tu.pop(td, "temperature", 1) == 1
    tu.assign_non_tensor(td, name="run", turns=[[1], [], [2, 3], [4]])
    assert tu.get_non_tensor_data(td, "name", None) == "run" and tu.get(td, "turns")[2] == [2, 3]
    with pytest.raises(ValueError, match="inconsistent"):
        tu.get_tensordict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="torch.Tensors"):
        tu.get_tensordict({"a": [torch.zeros(1)]})


def test_pad_unpad_make_iterator_and_list_of_dict():
    td = TensorDict({"x": torch.arange(5)}, [5])
    padded, pad = tu.pad_to_divisor(td, 4)
    assert pad == 3 and padded["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert tu.unpad(padded, pad)["x"].tolist() == [0, 1, 2, 3, 4]
    it = list(tu.make_iterator(TensorDict({"x": torch.arange(4)}, [4]), 2, epochs=2))
    assert [b["x"].tolist() for b in it] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    built = tu.list_of_dict_to_tensordict([{"a": torch.zeros(2), "b": torch.arange(1), "c": "u"},
                                           {"a": torch.ones(2), "b": torch.arange(3), "c": "v"}])
    assert built["a"].shape == (2, 2) and built["b"].is_nested and tu.get(built, "c") == ["u", "v"]
    cont = tu.contiguous(make_batch())
    assert tu.get(cont, "temperature") == 0.6 and cont["score"].is_contiguous()
