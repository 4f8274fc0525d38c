"""The helpers that turn data and reward failures into one-paragraph user errors (verl/utils/user_errors.py)
and the trainer's formatting of them; the end-to-end runs are in tests/trainer/test_cli_e2e.py and
tests/trainer/sft/test_sft_user_errors.py."""

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from verl.trainer.cli import format_error
from verl.utils.user_errors import (
    DeferredRowErrors,
    GuardedDataset,
    RowFailure,
    UserFacingError,
    guard,
    guard_reward_fn,
    raise_row_failures,
)


class Rows:
    """A dataset whose second row is malformed the way user data is: indexing it raises IndexError."""

    pad_token_id = 7

    def __init__(self):
        self.rows = [[1, 2], []]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"first": self.rows[i][0]}


def test_guard_converts_bad_input_but_not_bugs_unless_catch_all():
    with pytest.raises(UserFacingError) as err:
        with guard("Data", "Check data.train_files."):
            raise FileNotFoundError("no such file /x.parquet")
    assert err.value.paragraph() == "Data error: no such file /x.parquet. Check data.train_files."
    assert isinstance(err.value.__cause__, FileNotFoundError)
    # Around the project's own set-up code, a ZeroDivisionError is a bug: it keeps its type and traceback.
    with pytest.raises(ZeroDivisionError):
        with guard("Data"):
            raise ZeroDivisionError("bug")
    # Around user code, anything is the user's: converted, with its type named and the cause chained.
    with pytest.raises(UserFacingError, match=r"^Reward error: my_fn: ZeroDivisionError: division by zero\.") as err:
        with guard("Reward", where="my_fn", catch_all=True):
            1 / 0
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_guarded_dataset_names_the_row_for_any_exception():
    ds = GuardedDataset(Rows(), "data.train_files")
    assert ds[0] == {"first": 1} and len(ds) == 2 and ds.pad_token_id == 7
    with pytest.raises(UserFacingError) as err:
        ds[1]
    text = err.value.paragraph()
    assert text.startswith("Data error: row 1 of data.train_files: IndexError: list index out of range."), text
    assert "\n" not in text and isinstance(err.value.__cause__, IndexError)


def test_guarded_dataset_keeps_the_datasets_own_row_message():
    class Named(Rows):
        def __getitem__(self, i):
            raise ValueError(f"MyDataset: row {i} of /d.jsonl has no 'messages'")

    with pytest.raises(UserFacingError) as err:
        GuardedDataset(Named(), "data.val_files")[3]
    # The dataset said which row already (its file row may differ from the index): no second row number.
    assert err.value.message == "MyDataset: row 3 of /d.jsonl has no 'messages'"


def test_errors_survive_pickling_and_dataloader_workers():
    err = pickle.loads(pickle.dumps(UserFacingError("Data", "bad row", "Fix it.")))
    assert (err.kind, err.message, err.hint) == ("Data", "bad row", "Fix it.")
    guarded = pickle.loads(pickle.dumps(GuardedDataset(Rows(), "data.train_files")))
    assert guarded[0] == {"first": 1}
    # In a worker process the failing row comes back as a value and is raised again in this process.
    loader = DataLoader(DeferredRowErrors(GuardedDataset(Rows(), "data.train_files")), batch_size=2,
                        collate_fn=list, num_workers=1)
    (rows,) = list(loader)
    assert rows[0] == {"first": 1} and isinstance(rows[1], RowFailure)
    with pytest.raises(UserFacingError, match="row 1 of data.train_files: IndexError") as err:
        raise_row_failures(rows)
    assert "IndexError" in "".join(err.value.__notes__)  # the worker's traceback, shown with VERL_DEBUG=1
    assert raise_row_failures(rows[:1]) == rows[:1]


class ExplodingManager:
    """A user reward manager that raises a type no fixed list would expect."""

    def __call__(self, data, return_dict: bool = False):
        return {"reward_tensor": torch.zeros(1)} if data == "ok" else 1 / 0


def test_guard_reward_fn_converts_any_exception_and_keeps_the_signature():
    import inspect

    fn = guard_reward_fn(ExplodingManager(), "reward.reward_manager.name='exploding'")
    assert "return_dict" in inspect.signature(fn).parameters  # compute_reward still asks for the dict
    assert fn("ok")["reward_tensor"].shape == (1,)
    with pytest.raises(UserFacingError) as err:
        fn("bad", return_dict=True)
    text = err.value.paragraph()
    assert text.startswith("Reward error: ExplodingManager: ZeroDivisionError: division by zero."), text
    assert "reward.reward_manager.name='exploding'" in text and "VERL_DEBUG=1" in text


def test_compute_reward_without_reward_tensor_is_a_reward_error():
    from verl.trainer.ppo.reward import compute_reward

    def manager(data, return_dict=False):
        return {"scores": [1.0]}

    with pytest.raises(UserFacingError) as err:
        compute_reward(object(), manager)
    text, code = format_error(err.value)
    assert code == 1 and text.startswith("Reward error:") and "'reward_tensor'" in text and "['scores']" in text
    assert "manager" in text and "\n" not in text


def test_format_error_prints_user_errors_and_leaves_bugs():
    assert format_error(UserFacingError("Model", "model.path='/m' is not a directory", "Fix it.")) == (
        "Model error: model.path='/m' is not a directory. Fix it.", 1)
    assert format_error(UserFacingError("Config", "data.max_token_len_per_gpu=32 is too small"))[1] == 2
    assert format_error(ZeroDivisionError("bug")) is None
