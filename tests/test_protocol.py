import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl import DataProto
from verl.protocol import (
    DataProtoConfig,
    DataProtoItem,
    collate_fn,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def make(n=4, meta=None):
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 2).view(n, 2), "score": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info=meta if meta is not None else {"temperature": 1.0},
    )


def test_from_dict_and_len_and_consistency_errors():
    data = make(3)
    assert len(data) == 3
    assert data.batch.batch_size == torch.Size([3])
    assert data.non_tensor_batch["uid"].dtype == object
    # plain lists are converted to object arrays
    d2 = DataProto.from_dict({"a": torch.zeros(2)}, non_tensors={"t": ["x", "y"]})
    assert isinstance(d2.non_tensor_batch["t"], np.ndarray)
    with pytest.raises(ValueError, match="same batch size"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="not equal to batch size"):
        DataProto.from_dict({"a": torch.zeros(2)}, non_tensors={"t": ["x", "y", "z"]})
    with pytest.raises(ValueError, match="numpy.array"):
        DataProto(batch=None, non_tensor_batch={"t": ["x"]})
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict(non_tensors={"t": ["a", "b"]})) == 2


def test_from_single_dict_routes_types():
    data = DataProto.from_single_dict({"a": torch.ones(2, 3), "s": np.array(["p", "q"], dtype=object)}, {"k": 1})
    assert list(data.batch.keys()) == ["a"]
    assert list(data.non_tensor_batch) == ["s"]
    assert data.meta_info == {"k": 1}
    with pytest.raises(ValueError, match="Unsupported type"):
        DataProto.from_single_dict({"bad": [1, 2]})


def test_getitem_variants():
    data = make(5)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [4, 5] and item.non_tensor_batch["uid"] == "u2"
    assert data[-1].non_tensor_batch["uid"] == "u4"
    assert data[1:4:2].batch["ids"][:, 0].tolist() == [2, 6]
    assert data[[4, 0]].non_tensor_batch["uid"].tolist() == ["u4", "u0"]
    assert data[np.array([3, 1])].batch["ids"][:, 0].tolist() == [6, 2]
    assert data[torch.tensor([2])].batch["score"].tolist() == [1.0]
    mask = torch.tensor([True, False, True, False, True])
    picked = data[mask]
    assert len(picked) == 3 and picked.non_tensor_batch["uid"].tolist() == ["u0", "u2", "u4"]
    assert data[np.array([False] * 5)].batch.batch_size == torch.Size([0])
    with pytest.raises(TypeError, match="not supported"):
        data["ids"]


def test_select_and_deepcopy():
    data = make(2, meta={"a": [1], "b": 2})
    sub = data.select(batch_keys=["ids"], non_tensor_batch_keys=[], meta_info_keys=["a"])
    assert list(sub.batch.keys()) == ["ids"] and sub.non_tensor_batch == {} and sub.meta_info == {"a": [1]}
    copied = data.select(deepcopy=True)
    copied.meta_info["a"].append(5)
    assert data.meta_info["a"] == [1]
    shared = data.select()
    shared.meta_info["a"].append(7)
    assert data.meta_info["a"] == [1, 7]


def test_pop_and_rename():
    data = make(3, meta={"x": 1, "y": 2})
    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["x"])
    assert list(popped.batch.keys()) == ["score"] and "uid" in popped.non_tensor_batch
    assert list(data.batch.keys()) == ["ids"] and data.non_tensor_batch == {} and data.meta_info == {"y": 2}
    with pytest.raises(ValueError, match="missing"):
        data.pop(batch_keys=["missing"])
    data.rename("ids", "input_ids")
    assert list(data.batch.keys()) == ["input_ids"]
    with pytest.raises(ValueError, match="same length"):
        data.rename(["input_ids"], ["a", "b"])


def test_union_merges_and_detects_conflicts():
    a = DataProto.from_dict({"x": torch.arange(3)}, {"s": ["a", "b", "c"]}, {"m": 1})
    b = DataProto.from_dict({"x": torch.arange(3), "y": torch.ones(3)}, {"t": [1, 2, 3]}, {"n": 2})
    a.union(b)
    assert set(a.batch.keys()) == {"x", "y"} and set(a.non_tensor_batch) == {"s", "t"}
    assert a.meta_info == {"m": 1, "n": 2}

    clash = DataProto.from_dict({"x": torch.tensor([0, 1, 5])})
    with pytest.raises(ValueError, match="x"):
        a.union(clash)
    with pytest.raises(ValueError, match="`s`"):
        a.union(DataProto.from_dict({"x": torch.arange(3)}, {"s": ["a", "b", "Z"]}))
    with pytest.raises(ValueError, match="m"):
        a.union(DataProto.from_dict({"x": torch.arange(3)}, meta_info={"m": 99}))
    # NaN-containing object arrays compare equal to themselves
    nan_arr = np.array([float("nan"), "a"], dtype=object)
    merged = union_numpy_dict({"k": nan_arr}, {"k": np.array([float("nan"), "a"], dtype=object)})
    assert merged["k"][1] == "a"
    td = union_tensor_dict(TensorDict({"a": torch.ones(2)}, [2]), TensorDict({"b": torch.zeros(2)}, [2]))
    assert set(td.keys()) == {"a", "b"}


def test_chunk_split_concat():
    data = make(6, meta={"temperature": 0.5})
    parts = data.chunk(3)
    assert [p.batch["ids"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(p.meta_info == {"temperature": 0.5} for p in parts)
    back = DataProto.concat(parts)
    assert torch.equal(back.batch["ids"], data.batch["ids"])
    assert back.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()
    with pytest.raises(ValueError, match="equal chunk"):
        data.chunk(4)
    assert [len(p) for p in data.split(4)] == [4, 2]


def test_chunk_uneven_with_auto_padding():
    data = DataProto.from_dict({"a": torch.arange(5)}, auto_padding=True)
    assert [len(p) for p in data.chunk(2)] == [3, 2]
    plain = DataProto.from_dict({"a": torch.arange(5)})
    DataProtoConfig.auto_padding = True
    try:
        assert [len(p) for p in plain.chunk(3)] == [2, 2, 1]
    finally:
        DataProtoConfig.auto_padding = False
    with pytest.raises(ValueError):
        plain.chunk(3)


def test_concat_merges_metrics_and_meta():
    d1 = DataProto.from_dict({"a": torch.tensor([1])}, meta_info={"metrics": [{"loss": 1.0}], "flag": True})
    d2 = DataProto.from_dict({"a": torch.tensor([2])}, meta_info={"metrics": {"loss": 2.0, "acc": 0.5}})
    d3 = DataProto.from_dict({"a": torch.tensor([3])}, meta_info={"other": "x", "flag": True})
    out = DataProto.concat([d1, d2, d3])
    assert out.batch["a"].tolist() == [1, 2, 3]
    assert out.meta_info == {"metrics": {"loss": [1.0, 2.0], "acc": [0.5]}, "flag": True, "other": "x"}
    bad = DataProto.from_dict({"a": torch.tensor([4])}, meta_info={"flag": False})
    with pytest.raises(ValueError, match="Conflicting values for meta_info key 'flag'"):
        DataProto.concat([d1, bad])
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_repeat_interleave_vs_tile():
    data = DataProto.from_dict({"a": torch.tensor([[1, 1], [2, 2]])}, {"s": ["p", "q"]})
    inter = data.repeat(3, interleave=True)
    assert inter.batch["a"][:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert inter.non_tensor_batch["s"].tolist() == ["p", "p", "p", "q", "q", "q"]
    tiled = data.repeat(2, interleave=False)
    assert tiled.batch["a"][:, 0].tolist() == [1, 2, 1, 2]
    assert tiled.non_tensor_batch["s"].tolist() == ["p", "q", "p", "q"]
    levels = data.sample_level_repeat([1, 3])
    assert levels.non_tensor_batch["s"].tolist() == ["p", "q", "q", "q"]
    with pytest.raises(ValueError):
        data.sample_level_repeat([1])


def test_reorder_and_padding():
    data = make(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert data.non_tensor_batch["uid"].tolist() == ["u2", "u0", "u1"]
    assert data.batch["ids"][:, 0].tolist() == [4, 0, 2]
    data.padding(2)  # repeats the last row
    assert data.non_tensor_batch["uid"].tolist() == ["u2", "u0", "u1", "u1", "u1"]


@pytest.mark.parametrize("n,divisor,expected_pad", [(5, 4, 3), (2, 7, 5), (8, 4, 0)])
def test_pad_unpad_round_trip(n, divisor, expected_pad):
    data = make(n)
    padded, pad = pad_dataproto_to_divisor(data, divisor)
    assert pad == expected_pad and len(padded) % divisor == 0
    # padding repeats rows from the start, cycling when pad > n
    expected_rows = [i % n for i in range(n + pad)]
    assert padded.batch["ids"][:, 0].tolist() == [2 * i for i in expected_rows]
    restored = unpad_dataproto(padded, pad)
    assert torch.equal(restored.batch["ids"], data.batch["ids"])
    assert restored.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()


def test_pickle_round_trip_and_disk(tmp_path, monkeypatch):
    data = make(3, meta={"temperature": 0.7, "nested": {"a": [1, 2]}})
    data.batch["bf"] = torch.randn(3, 2).to(torch.bfloat16)
    for method in (None, "numpy"):
        if method:
            monkeypatch.setenv("VERL_DATAPROTO_SERIALIZATION_METHOD", method)
        back = pickle.loads(pickle.dumps(data))
        assert set(back.batch.keys()) == {"ids", "score", "bf"}
        for key in back.batch.keys():
            assert back.batch[key].dtype == data.batch[key].dtype
            assert torch.equal(back.batch[key], data.batch[key])
        assert back.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
        assert back.meta_info == data.meta_info
    path = tmp_path / "d.pkl"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.equal(loaded.batch["ids"], data.batch["ids"])


def test_serialize_nested_tensordict():
    nt = torch.nested.as_nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    td = TensorDict({"ids": nt, "x": torch.ones(2, 2)}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(td))
    assert [t.tolist() for t in back["ids"].unbind()] == [[0, 1], [0, 1, 2]]
    assert torch.equal(back["x"], td["x"])


def test_make_iterator_and_collate():
    data = make(4, meta={"k": "v"})
    batches = list(data.make_iterator(mini_batch_size=2, epochs=2))
    assert len(batches) == 4
    assert batches[0].batch["ids"][:, 0].tolist() == [0, 2] and batches[0].meta_info == {"k": "v"}
    assert batches[3].non_tensor_batch["uid"].tolist() == ["u2", "u3"]
    def uids(seed):
        loader = data.make_iterator(2, 1, seed=seed, dataloader_kwargs={"shuffle": True})
        return [b.non_tensor_batch["uid"].tolist() for b in loader]

    shuffled, again = uids(1), uids(1)
    assert shuffled == again and sorted(sum(shuffled, [])) == ["u0", "u1", "u2", "u3"]
    with pytest.raises(ValueError, match="divide"):
        data.make_iterator(3, 1)
    merged = collate_fn([data[1], data[3]])
    assert merged.batch["ids"][:, 0].tolist() == [2, 6]


def test_fold_unfold_and_column_chunks():
    data = make(4)
    folded = fold_batch_dim(data, 2)
    assert folded.batch.batch_size == torch.Size([2]) and folded.batch["ids"].shape == (2, 2, 2)
    assert folded.non_tensor_batch["uid"].shape == (2, 2)
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert torch.equal(flat.batch["ids"], data.batch["ids"])
    wide = DataProto.from_dict({"w": torch.arange(8).view(2, 4), "k": torch.tensor([7, 9])})
    out = wide.unfold_column_chunks(2, split_keys=["w"])
    assert out.batch["w"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert out.batch["k"].tolist() == [7, 7, 9, 9]


def test_tensordict_conversion_round_trip():
    data = DataProto.from_dict({"a": torch.arange(2)}, {"msgs": [[{"role": "user"}], []]}, {"step": 3})
    td = data.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert back.batch["a"].tolist() == [0, 1]
    assert back.non_tensor_batch["msgs"][0] == [{"role": "user"}] and back.non_tensor_batch["msgs"][1] == []
    assert back.meta_info == {"step": 3}


def test_to_device_and_info(capsys):
    data = make(2, meta={"m": [1, 2]})
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")
    info = data.get_data_info()
    assert "ids: (2, 2) (torch.int64)" in info and "m: list[int]" in info
    data.print_size(prefix="x")
    assert capsys.readouterr().out.startswith("x, Size of tensordict")


def test_future_chunk_dispatch_and_batchdata_without_ray():
    from verl.protocol import BatchData, DataProtoFuture

    data = make(4)
    future = DataProtoFuture.concat(["ref0", "ref1"])
    second = future.chunk(2)[1]
    # dispatch functions must survive pickling (Ray ships them to workers)
    dispatch = pickle.loads(pickle.dumps(second.dispatch_fn))
    assert dispatch(data).non_tensor_batch["uid"].tolist() == ["u2", "u3"]
    assert BatchData(data).is_chunkable() and not BatchData([]).is_concatable()
    parts = BatchData(data).chunk(2)
    assert BatchData(list(parts)).is_concatable()
    assert BatchData(list(parts)).concat().batch["ids"].tolist() == data.batch["ids"].tolist()


def test_package_import_stays_light():
    import subprocess
    import sys

    code = "import sys, verl; assert 'torch' not in sys.modules; from verl import DataProto; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
