"""Fixtures shared by the SFT trainer tests."""

import pytest


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """Four steps of the SFT demo without a break (``COMMON``): what every resumed run is compared with, run once
    for test_sft_trainer.py and test_sft_faults.py."""
    from tests.trainer.sft.test_sft_trainer import COMMON, run_in_process

    return run_in_process(tmp_path_factory.mktemp("sft_straight"),
                          [*COMMON, "trainer.save_freq=-1", "trainer.resume_mode=disable"])
