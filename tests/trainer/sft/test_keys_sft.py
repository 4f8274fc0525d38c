"""The SFT trainer's ``data`` and ``trainer`` keys (``sft_trainer_engine``) shape its dataset and its loop.

Each test composes the SFT config with the key changed, as ``python -m verl.trainer.sft_trainer`` does, and
hands the composed section to what the trainer builds from it: the multi-turn dataset
(``create_sft_dataset``), the per-step settings the engine receives, the epoch order, the data loader and the
checkpoint pruning (on an SFTTrainer without a model). The key names are spelled out so key_status.txt can
point here.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.sft_trainer import compose_sft_config, create_sft_dataset
from verl.utils.dataset.multiturn_sft_dataset import SFTRowError


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _cfg(*overrides):
    cfg, _ = compose_sft_config(["model.path=/m", "data.train_files=x", *overrides])
    return cfg


def _ds(tok, tmp_path, rows, *overrides):
    path = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return create_sft_dataset(str(path), _cfg(*overrides).data, tok, None)


U, A = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}


def test_messages_key(tok, tmp_path):
    ds = _ds(tok, tmp_path, [{"conv": [U, A]}], "data.messages_key=conv")
    assert int(ds[0]["loss_mask"].sum()) > 0
    with pytest.raises(SFTRowError, match="no messages under data.messages_key='messages'"):
        _ds(tok, tmp_path, [{"conv": [U, A]}])[0]


def test_tools_key(tok, tmp_path):
    row = {"messages": [U, A], "fns": "[not json"}
    with pytest.raises(SFTRowError, match="'fns' is a string but not valid JSON"):
        _ds(tok, tmp_path, [row], "data.tools_key=fns")[0]
    _ds(tok, tmp_path, [row])[0]  # the default key reads another column: no tools
    tools = json.dumps([{"type": "function", "function": {"name": "add", "parameters": {"a": "int"}}}])
    with_tools = _ds(tok, tmp_path, [{"messages": [U, A], "fns": tools}], "data.tools_key=fns")[0]
    assert "add" in tok.decode(with_tools["input_ids"].tolist())


def test_enable_thinking_key(tok, tmp_path):
    row = {"messages": [U, A], "think": "yes"}
    with pytest.raises(SFTRowError, match="must be true, false or null"):
        _ds(tok, tmp_path, [row], "data.enable_thinking_key=think")[0]
    _ds(tok, tmp_path, [row])[0]  # the default key names another column


def test_max_length_and_pad_mode(tok, tmp_path):
    item = _ds(tok, tmp_path, [{"messages": [U, A]}], "data.pad_mode=right", "data.max_length=64")[0]
    assert item["input_ids"].shape == (64,)
    packed = _ds(tok, tmp_path, [{"messages": [U, A]}], "data.pad_mode=no_padding", "data.max_length=64")[0]
    assert packed["input_ids"].shape[0] < 64
    long = [{"messages": [{"role": "user", "content": "x" * 40}, A]}]
    with pytest.raises(SFTRowError, match="longer than data.max_length=30"):
        _ds(tok, tmp_path, long, "data.max_length=30")[0]


# ------------------------------------------------------------------------------------------ the loop
def _trainer(*overrides, rows=40):
    from verl.trainer.sft.trainer import SFTTrainer

    t = SFTTrainer.__new__(SFTTrainer)  # the loop's bookkeeping only: no model, no data files
    t.config = _cfg("data.train_batch_size=8", *overrides)
    t.train_dataset = list(range(rows))
    t._plan_steps()
    return t


def test_micro_batch_and_token_budget_settings():
    meta = _trainer("data.micro_batch_size_per_gpu=3", "data.use_dynamic_bsz=false")._meta()
    assert meta["micro_batch_size"] == 3 and meta["use_dynamic_bsz"] is False
    meta = _trainer("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=321")._meta()
    assert meta["use_dynamic_bsz"] is True and meta["max_token_len"] == 321


def test_trainer_seed_orders_the_epochs():
    a, b = _trainer("trainer.seed=1").order(0), _trainer("trainer.seed=2").order(0)
    assert sorted(a) == sorted(b) == list(range(40)) and a != b
    assert _trainer("trainer.seed=1").order(0) == a  # the same seed, the same order


def test_num_workers_is_the_loaders():
    assert _trainer("data.num_workers=0")._loader(0, 0).num_workers == 0
    assert _trainer("data.num_workers=2")._loader(0, 0).num_workers == 2


def test_max_ckpt_to_keep_prunes_old_checkpoints(tmp_path):
    for s in (1, 2, 3, 4):
        (tmp_path / f"global_step_{s}").mkdir()
    _trainer("trainer.max_ckpt_to_keep=2")._prune(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_4"]
    _trainer("trainer.max_ckpt_to_keep=null")._prune(str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 2
