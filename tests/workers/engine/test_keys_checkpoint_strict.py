"""``actor_rollout_ref.actor.checkpoint.strict`` / ``critic.checkpoint.strict``: the Megatron engine's hf_model
export against the source checkpoint. The export itself runs on CPU here: the gathered weights come from a
stand-in stream (megatron-core is not installed on the CPU machine), everything after it is the engine's code."""

from __future__ import annotations

import os
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from verl.utils.checkpoint.hf_export import reconcile_export, source_tensor_names
from verl.workers.engine.megatron import checkpoint as mcore_ckpt
from verl.workers.engine.role import engine_role

SOURCE = {"model.embed_tokens.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2),
          "mtp.fc.weight": torch.ones(2, 2)}  # the source carries an MTP head the trained model never builds
EXPORTED = {"model.embed_tokens.weight": torch.full((4, 2), 2.0), "model.norm.weight": torch.full((2,), 3.0),
            "model.extra.weight": torch.zeros(1)}


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


def _engine(source_dir, role, strict):
    return types.SimpleNamespace(hf_config=PretrainedConfig(tie_word_embeddings=False), model_path=str(source_dir),
                                 processing_class=_NoTokenizer(), role_spec=engine_role(role),
                                 checkpoint_config={"save_contents": ["hf_model"], "strict": strict})


@pytest.fixture
def source_dir(tmp_path):
    path = tmp_path / "src"
    path.mkdir()
    save_file(SOURCE, str(path / "model.safetensors"))
    return path


@pytest.fixture
def exported(monkeypatch):
    from verl.workers.engine.megatron import weights

    monkeypatch.setattr(weights, "iter_hf_weights", lambda engine: iter(EXPORTED.items()))


@pytest.mark.parametrize("role, key", [("actor", "actor_rollout_ref.actor.checkpoint.strict"),
                                       ("critic", "critic.checkpoint.strict")])
def test_strict_true_refuses_an_export_that_differs_from_the_source(gloo, source_dir, exported, tmp_path, role, key):
    with pytest.raises(RuntimeError, match=f"{key}=true") as info:
        mcore_ckpt.save_hf_checkpoint(_engine(source_dir, role, True), str(tmp_path / "out"))
    assert "mtp.fc.weight" in str(info.value) and "model.extra.weight" in str(info.value)
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_strict_false_writes_the_tensors_the_source_has(gloo, source_dir, exported, tmp_path):
    mcore_ckpt.save_hf_checkpoint(_engine(source_dir, "actor", False), str(tmp_path / "out"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == {"model.embed_tokens.weight", "model.norm.weight"}  # unknown skipped, MTP absent
    assert torch.equal(written["model.norm.weight"], EXPORTED["model.norm.weight"])


def test_matching_export_passes_strict_and_tied_head_is_left_out(gloo, source_dir, monkeypatch, tmp_path):
    from verl.workers.engine.megatron import weights

    same = {**{k: v + 1 for k, v in SOURCE.items()}, "lm_head.weight": torch.zeros(4, 2)}
    monkeypatch.setattr(weights, "iter_hf_weights", lambda engine: iter(same.items()))
    engine = _engine(source_dir, "actor", True)
    engine.hf_config = PretrainedConfig(tie_word_embeddings=True)
    mcore_ckpt.save_hf_checkpoint(engine, str(tmp_path / "out"))
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(SOURCE)


def test_source_names_come_from_the_index_and_no_safetensors_means_no_check(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x.safetensors"}}')
    assert source_tensor_names(str(tmp_path)) == {"a"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert source_tensor_names(str(empty)) is None
    assert reconcile_export({"b": 1}, None, True, "k") == {"b": 1}
