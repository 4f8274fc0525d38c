import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.ppo.reward import compute_reward, extract_reward, get_custom_reward_fn, load_reward_manager
from verl.workers.reward_manager import NaiveRewardManager, get_reward_manager_cls, register

PROMPT_LEN, RESP_LEN = 6, 8


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _obj(values):
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def make_batch(tok, responses, sources, truths, extra_infos=None, prompt="q"):
    """Left-padded prompts, right-padded responses, as the rollout produces them."""
    b = len(responses)
    prompts = torch.full((b, PROMPT_LEN), tok.pad_token_id)
    resp = torch.full((b, RESP_LEN), tok.pad_token_id)
    mask = torch.zeros(b, PROMPT_LEN + RESP_LEN, dtype=torch.long)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    for i, text in enumerate(responses):
        prompts[i, PROMPT_LEN - len(p_ids) :] = torch.tensor(p_ids)
        mask[i, PROMPT_LEN - len(p_ids) : PROMPT_LEN] = 1
        r_ids = tok.encode(text, add_special_tokens=False)[:RESP_LEN]
        if r_ids:
            resp[i, : len(r_ids)] = torch.tensor(r_ids)
            mask[i, PROMPT_LEN : PROMPT_LEN + len(r_ids)] = 1
    non_tensors = {
        "data_source": _obj(sources),
        "reward_model": _obj([{"style": "rule", "ground_truth": t} for t in truths]),
    }
    if extra_infos is not None:
        non_tensors["extra_info"] = _obj(extra_infos)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": resp, "attention_mask": mask},
        non_tensors=non_tensors,
    )


def test_scores_on_last_valid_token(tok):
    data = make_batch(tok, ["aaaa", "ab", "zz<|im_end|>"], ["letter_echo"] * 3, ["a", "a", "z"])
    out = NaiveRewardManager(tok, num_examine=0)(data)
    assert out.shape == (3, RESP_LEN) and out.dtype == torch.float32
    expected = torch.zeros(3, RESP_LEN)
    expected[0, 3] = 1.0
    expected[1, 1] = 0.25
    expected[2, 2] = 0.5  # <|im_end|> is one token and is skipped when decoding
    assert torch.equal(out, expected)


def test_empty_response_does_not_crash(tok):
    data = make_batch(tok, ["", "aaaa"], ["letter_echo"] * 2, ["a", "a"])
    out = NaiveRewardManager(tok, num_examine=0)(data)
    assert out[0].abs().sum() == 0 and out[1, 3] == 1.0


def test_dict_scores_and_extra_info(tok):
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        if solution_str == "x":
            return {"score": 2, "acc": True}
        return {"score": 0.5, "pred": solution_str}

    data = make_batch(tok, ["x", "yy"], ["s1", "s2"], ["g1", "g2"], extra_infos=[{"index": 4}, None])
    out = NaiveRewardManager(tok, 0, compute_score=scorer)(data, return_dict=True)
    assert out["reward_tensor"][0, 0] == 2.0 and out["reward_tensor"][1, 1] == 0.5
    info = out["reward_extra_info"]
    assert info["score"] == [2, 0.5] and info["acc"] == [True, None] and info["pred"] == [None, "yy"]
    assert seen[0][:3] == ("s1", "x", "g1") and seen[0][3]["index"] == 4
    assert "num_turns" in seen[1][3]


def test_custom_reward_fn_key(tok):
    data = make_batch(tok, ["aaaa"], ["ignored"], ["a"])
    data.non_tensor_batch["task"] = _obj(["letter_echo"])
    out = NaiveRewardManager(tok, 0, reward_fn_key="task")(data)
    assert out[0, 3] == 1.0


def test_scorer_exception_names_function_source_and_row(tok):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise ZeroDivisionError("boom")
        return 1.0

    data = make_batch(tok, ["ok", "bad"], ["srcA", "srcB"], ["g", "g"])
    with pytest.raises(RuntimeError, match=r"flaky raised ZeroDivisionError on row 1 \(data_source='srcB'\): boom"):
        NaiveRewardManager(tok, 0, compute_score=flaky)(data)


@pytest.mark.parametrize("bad", ["1.0", None, {"acc": 1}, {"score": "high"}])
def test_non_numeric_result_is_an_error(tok, bad):
    def returns_bad(data_source, solution_str, ground_truth, extra_info=None):
        return bad

    data = make_batch(tok, ["a"], ["srcX"], ["g"])
    with pytest.raises((TypeError, ValueError), match=r"returns_bad.*row 0.*srcX"):
        NaiveRewardManager(tok, 0, compute_score=returns_bad)(data)


def test_unknown_source_surfaces(tok):
    data = make_batch(tok, ["a"], ["mystery"], ["g"])
    with pytest.raises(RuntimeError, match="mystery.*custom_reward_function"):
        NaiveRewardManager(tok, 0)(data)


def test_missing_keys(tok):
    data = make_batch(tok, ["a"], ["letter_echo"], ["a"])
    with pytest.raises(KeyError, match="'task'.*reward_fn_key"):
        NaiveRewardManager(tok, 0, reward_fn_key="task")(data)
    data.non_tensor_batch["reward_model"] = _obj([{"style": "rule"}])
    with pytest.raises(KeyError, match="row 0.*ground_truth"):
        NaiveRewardManager(tok, 0)(data)


def test_prints_num_examine_per_source(tok, capsys):
    data = make_batch(tok, ["aaaa", "bbbb", "cccc"], ["letter_echo", "letter_echo", "other"], ["a", "b", "c"])

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    NaiveRewardManager(tok, num_examine=1, compute_score=scorer)(data)
    printed = capsys.readouterr().out
    assert printed.count("[response]") == 2 and "[response] aaaa" in printed and "[response] cccc" in printed
    assert "[prompt] q" in printed


def test_rm_scores_short_circuit(tok):
    data = make_batch(tok, ["a"], ["mystery"], ["g"])
    data.batch["rm_scores"] = torch.ones(1, RESP_LEN)
    assert torch.equal(NaiveRewardManager(tok, 0)(data), torch.ones(1, RESP_LEN))
    tensor, extra = extract_reward(data)
    assert torch.equal(tensor, torch.ones(1, RESP_LEN)) and extra == {}


def test_registry():
    assert get_reward_manager_cls("naive") is NaiveRewardManager

    @register("test_only_manager")
    class Mine:
        pass

    assert get_reward_manager_cls("test_only_manager") is Mine
    with pytest.raises(ValueError, match="already registered"):
        register("naive")(type("Other", (), {}))
    with pytest.raises(ValueError, match=r"'nope' is not a registered reward manager.*naive"):
        get_reward_manager_cls("nope")


def _write_reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str == ground_truth) + bonus\n"
    )
    return str(path)


@pytest.mark.parametrize("newer", [True, False])
def test_custom_reward_fn_both_locations(tok, tmp_path, newer):
    section = {"path": _write_reward_file(tmp_path), "name": "my_score", "reward_kwargs": {"bonus": 0.5}}
    cfg = {"reward": {"custom_reward_function": section}} if newer else {"custom_reward_function": section}
    cfg = OmegaConf.create(cfg)
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="d", solution_str="x", ground_truth="x") == 1.5
    manager = load_reward_manager(cfg, tok, num_examine=0)
    reward, extra = compute_reward(make_batch(tok, ["x", "y"], ["d", "d"], ["x", "x"]), manager)
    assert reward[0, 0] == 1.5 and reward[1, 0] == 0.5 and extra == {}


def test_custom_reward_fn_errors(tmp_path):
    assert get_custom_reward_fn(OmegaConf.create({"custom_reward_function": {"path": None}})) is None
    missing = OmegaConf.create({"custom_reward_function": {"path": str(tmp_path / "gone.py"), "name": "f"}})
    with pytest.raises(FileNotFoundError, match="gone.py"):
        get_custom_reward_fn(missing)
    wrong = OmegaConf.create({"custom_reward_function": {"path": _write_reward_file(tmp_path), "name": "nope"}})
    with pytest.raises(AttributeError, match=r"my_reward\.py.*'nope'"):
        get_custom_reward_fn(wrong)


def test_custom_fn_error_names_user_function(tok, tmp_path):
    path = tmp_path / "bad_reward.py"
    path.write_text("def scorer(**kw):\n    raise KeyError('oops')\n")
    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(path), "name": "scorer"}}})
    manager = load_reward_manager(cfg, tok, 0)
    with pytest.raises(RuntimeError, match=r"scorer \(from .*bad_reward\.py\).*row 0"):
        compute_reward(make_batch(tok, ["a"], ["d"], ["a"]), manager)


def test_load_reward_manager_defaults_and_legacy_name(tok):
    cfg = OmegaConf.create({"reward_model": {"reward_manager": "naive"}, "data": {"reward_fn_key": "task"}})
    manager = load_reward_manager(cfg, tok, 2)
    assert isinstance(manager, NaiveRewardManager) and manager.reward_fn_key == "task" and manager.num_examine == 2
    manager = load_reward_manager(OmegaConf.create({"reward": {"reward_manager": {"name": "naive"}}}), tok, 0)
    assert isinstance(manager, NaiveRewardManager)
    with pytest.raises(ValueError, match="'dapo_x' is not a registered reward manager"):
        load_reward_manager(OmegaConf.create({"reward_model": {"reward_manager": "dapo_x"}}), tok, 0)


def test_compute_reward_with_plain_callable(tok):
    data = make_batch(tok, ["a"], ["letter_echo"], ["a"])
    reward, extra = compute_reward(data, lambda d: torch.full((1, RESP_LEN), 3.0))
    assert reward[0, 0] == 3.0 and extra == {}
    reward, extra = compute_reward(data, NaiveRewardManager(tok, 0))
    assert reward[0, 0] == 0.25 and extra == {}


def test_compute_score_timeout_scores_zero(tok, capsys):
    import time

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            time.sleep(5)
        return 1.0

    data = make_batch(tok, ["slow", "fast"], ["d", "d"], ["g", "g"])
    out = NaiveRewardManager(tok, 0, compute_score=slow, compute_score_timeout=0.2)(data)
    assert out[0].sum() == 0.0 and out[1, 3] == 1.0
    assert "exceeded 0.2s on row 0" in capsys.readouterr().out


# --------------------------------------------------------------------------- async scorers, GenRM arguments
def test_async_scorer_runs_rows_concurrently_with_router_arguments(tok):
    import asyncio
    import threading

    seen, lock, in_flight = [], threading.Lock(), {"now": 0, "max": 0}

    async def judge(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                    reward_model_tokenizer):
        with lock:
            in_flight["now"] += 1
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
        await asyncio.sleep(0.2)  # a judge request: all rows should be waiting at once
        with lock:
            in_flight["now"] -= 1
            seen.append((solution_str, reward_router_address, reward_model_tokenizer))
        return {"score": float(len(solution_str)), "genrm_verdict": "ok"}

    data = make_batch(tok, ["a", "bb", "ccc", "dddd"], ["s"] * 4, ["x"] * 4)
    manager = NaiveRewardManager(tok, num_examine=0, compute_score=judge, reward_router_address="127.0.0.1:9",
                                 reward_model_tokenizer="judge-tok")
    out = manager(data, return_dict=True)
    assert in_flight["max"] == 4
    assert sorted(seen) == [(s, "127.0.0.1:9", "judge-tok") for s in ["a", "bb", "ccc", "dddd"]]
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 2.0, 3.0, 4.0]  # each row keeps its own score
    assert out["reward_extra_info"]["genrm_verdict"] == ["ok"] * 4


def test_router_arguments_only_when_a_router_is_set_and_async_timeout(tok):
    import asyncio

    async def plain(data_source, solution_str, ground_truth, extra_info):  # upstream: no router, no extra kwargs
        return 1.0

    data = make_batch(tok, ["a", "b"], ["s"] * 2, ["x"] * 2)
    assert NaiveRewardManager(tok, num_examine=0, compute_score=plain)(data).sum().item() == 2.0

    async def slow(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(5)
        return 1.0

    out = NaiveRewardManager(tok, num_examine=0, compute_score=slow, compute_score_timeout=0.1)(data)
    assert out.sum().item() == 0.0  # over compute_score_timeout: scored 0.0, as the synchronous path does

    async def broken(data_source, solution_str, ground_truth, extra_info):
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="raised KeyError on row"):
        NaiveRewardManager(tok, num_examine=0, compute_score=broken)(data)
