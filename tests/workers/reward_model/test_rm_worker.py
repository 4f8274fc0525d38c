"""The reward-model worker against a direct Hugging Face forward of the same checkpoint on the same text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto

# A chat template unlike the policy's (Qwen-style <|im_start|>): the reward model must see its own format.
RM_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.models.tiny import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("rm")
    build_tiny_qwen3_5(root / "policy", kind="dense", seed=0)
    build_tiny_qwen3_5(root / "rm", kind="seq_cls", seed=1, with_tokenizer=False)
    build_tiny_tokenizer(root / "rm", chat_template=RM_TEMPLATE)
    return root


def _batch(policy_tok, chats, responses, prompt_len=24, resp_len=12) -> DataProto:
    """The layout generation leaves: left-padded prompts, right-padded responses."""
    rows, masks, resp = [], [], []
    for chat, text in zip(chats, responses):
        p = policy_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p)[-prompt_len:]
        r = policy_tok(text, add_special_tokens=False)["input_ids"][: resp_len - 1] + [policy_tok.eos_token_id]
        pad = policy_tok.pad_token_id
        rows.append([pad] * (prompt_len - len(p)) + p + r + [pad] * (resp_len - len(r)))
        masks.append([0] * (prompt_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (resp_len - len(r)))
        resp.append(r + [pad] * (resp_len - len(r)))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "responses": torch.tensor(resp),
                 "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"raw_prompt": np.array(chats, dtype=object)})


def test_scores_equal_hf_sequence_classification_forward(dirs, monkeypatch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from verl.single_controller.worker_group import create_local_worker_groups
    from verl.workers.reward_model.worker import RewardModelWorker

    from verl.utils.net import find_free_port

    # The in-process launcher writes the rendezvous variables into os.environ; set them through monkeypatch so
    # they are removed afterwards (a later subprocess inheriting this MASTER_PORT would find it taken).
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(find_free_port()))):
        monkeypatch.setenv(key, value)
    rm_cfg = OmegaConf.create({"enable": True, "model_path": str(dirs / "rm"),
                               "rollout": {"name": "hf", "dtype": "float32", "max_num_batched_tokens": 40}})
    policy_cfg = OmegaConf.create({"path": str(dirs / "policy"), "use_remove_padding": True})
    wg = create_local_worker_groups({"reward_model": (RewardModelWorker, (rm_cfg, policy_cfg), {})})["reward_model"]
    wg.init_model()
    # reward.reward_model.rollout.max_num_batched_tokens=40 caps the real tokens of one packed micro-batch: the
    # three rows (about 25-35 tokens each in the RM's format) run as three forwards.
    import verl.workers.engine.fsdp.engine as fsdp_engine

    sizes = []
    real_split = fsdp_engine.split_micro_batches

    def spy(*args, **kwargs):
        micro, order = real_split(*args, **kwargs)
        sizes.extend(int(mb["attention_mask"].sum()) for mb in micro)
        return micro, order

    monkeypatch.setattr(fsdp_engine, "split_micro_batches", spy)
    policy_tok = AutoTokenizer.from_pretrained(str(dirs / "policy"))
    chats = [[{"role": "user", "content": "add 2 and 3"}], [{"role": "user", "content": "hi"}],
             [{"role": "user", "content": "count to 4"}]]
    responses = ["5", "hello there", "1 2 3 4"]
    data = _batch(policy_tok, [np.array(c, dtype=object) for c in chats], responses)
    rm_scores = wg.compute_rm_score(data).batch["rm_scores"]

    rm_tok = AutoTokenizer.from_pretrained(str(dirs / "rm"))
    hf = AutoModelForSequenceClassification.from_pretrained(str(dirs / "rm"), dtype=torch.float32).eval()
    resp_len = data.batch["responses"].size(-1)
    valid = data.batch["attention_mask"][:, -resp_len:].sum(-1)
    expected = []
    for chat, text in zip(chats, responses):
        rendered = rm_tok.apply_chat_template(chat + [{"role": "assistant", "content": text}], tokenize=False)
        assert rendered.startswith("user: ") and "<|im_start|>" not in rendered  # the RM's template, not the policy's
        ids = torch.tensor([rm_tok(rendered)["input_ids"]])
        with torch.no_grad():
            expected.append(hf(input_ids=ids).logits[0, -1].item())
    for i, want in enumerate(expected):
        row = rm_scores[i]
        last = int(valid[i]) - 1
        assert row[last].item() == pytest.approx(want, abs=1e-4)  # the score sits on the last response token
        assert torch.count_nonzero(row).item() == 1
    # Different texts, different scores: the parity above is not a constant head.
    assert len({round(x, 4) for x in expected}) == 3
    assert len(sizes) == 3 and max(sizes) <= 40, sizes


def test_rollout_dtype_is_the_compute_dtype():
    """reward.reward_model.rollout.dtype is the dtype the reward model computes in on accelerators (FSDP2's
    param_dtype over fp32 master weights); the CPU computes in the weights' dtype."""
    from verl.workers.engine.fsdp.model_init import precision_policy
    from verl.workers.reward_model.worker import engine_config_for

    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        role, model = engine_config_for(OmegaConf.create({"model_path": "/m", "rollout": {"dtype": name}}))
        assert precision_policy(role.fsdp_config, torch.float32).param_dtype == dtype
        assert model.path == "/m" and role.strategy == "fsdp2"
    role, _ = engine_config_for(OmegaConf.create({"model_path": "/m", "rollout": {"dtype": "float32"}}))
    assert precision_policy(role.fsdp_config, torch.float32) is None  # nothing to cast


def test_a_causal_lm_is_refused_as_reward_model(dirs):
    from verl.workers.reward_model.score_model import load_score_model

    with pytest.raises(ValueError, match="not a sequence-classification model"):
        load_score_model(str(dirs / "policy"), torch.float32)


def test_missing_raw_chat_is_named(dirs):
    from transformers import AutoTokenizer

    from verl.workers.reward_model.worker import build_rm_inputs

    tok = AutoTokenizer.from_pretrained(str(dirs / "policy"))
    data = DataProto.from_dict(tensors={"responses": torch.ones(1, 2, dtype=torch.long),
                                        "attention_mask": torch.ones(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="data.return_raw_chat"):
        build_rm_inputs(data, tok, tok)
