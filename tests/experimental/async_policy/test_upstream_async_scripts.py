"""Upstream verl's scripts for the asynchronous modes, as a verl user would start them (issue 26's "upstream's
async scripts compose"), through their entry point's ``main ... --cfg job``.

``scripts/extract_upstream_commands.py --suite async`` ran every ``*.sh`` of upstream's
``verl/experimental/{fully_async_policy,one_step_off_policy}/shell`` under stand-in commands and recorded the
module each launches (``fully_async_main``, ``one_step_off_policy.main_ppo``, or ``verl.trainer.main_ppo`` for
the colocated baselines) with its arguments in ``data/upstream_async_commands.json`` (upstream's commit is
recorded there). Every script either composes and validates, or is refused for the reason in ``EXPECTED``
exactly: a script that starts to compose fails here until its entry is removed.

* ``declined``: an engine this project leaves out on purpose (SGLang, TRT-LLM, MindSpeed for Megatron on Ascend).
* ``pending``: built for the synchronous trainer, not yet for the asynchronous rollouter (agent loops).
* ``upstream``: the script fails on upstream's own tree the same way (a config its tree lacks, keys its config
  does not have, a bash error).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import pytest
import yaml

DATA = Path(__file__).parent / "data" / "upstream_async_commands.json"
COMMANDS = json.loads(DATA.read_text())
MODES = {"verl.experimental.fully_async_policy.fully_async_main": "fully_async",
         "verl.experimental.one_step_off_policy.main_ppo": "one_step_off"}

F = "verl/experimental/fully_async_policy/shell/"
O = "verl/experimental/one_step_off_policy/shell/"
SGLANG = ("declined", "`actor_rollout_ref.rollout.name` is 'sglang', which selects the SGLang rollout engine")
MINDSPEED = ("declined", "upstream runs through MindSpeed (Megatron on Ascend): this project does not implement")
EXPECTED: dict[str, Optional[tuple[str, str]]] = {
    # upstream's config folder has no fully_async_dapo_trainer.yaml either (Hydra fails the same there)
    F + "dapo_30b_a3b_base_math_fsdp.sh": ("upstream", "Cannot find primary config 'fully_async_dapo_trainer'"),
    F + "dapo_7b_async_retool.sh": ("pending", "agent loops are not run by the asynchronous rollouter yet"),
    F + "geo3k_qwen3vl_30b_megatron_6_2_npu_async.sh": MINDSPEED,
    F + "grpo_qwen3_235b_megatron_npu.sh": MINDSPEED,
    F + "grpo_30b_a3b_base_math_megatron_8_8_mis_trtllm.sh": ("declined", "belong to the TRT-LLM rollout engine"),
    F + "grpo_8b_base_math_megatron_4_4_trtllm.sh": ("declined", "selects the TRT-LLM rollout engine"),
    # SGLang besides, upstream's own Hydra refuses it: rollout.single_turn_response_length is no key of upstream's
    # config, and `+algorithm.filter_groups.enable` adds to a key its config sets (enable: false)
    F + "grpo_qwen35_35b_megatron_async.sh": ("upstream", "`actor_rollout_ref.rollout.single_turn_response_length` "
                                                          "is not a config key"),
    # `${True}` under `set -u`: bash stops at the script's line 55 before launching anything
    F + "run_qwen35_35b_a3b_math_dynamic_megatron.sh": ("upstream", "True: unbound variable"),
    O + "dapo_7b_math_fsdp2_sglang_4_12.sh": SGLANG,
    O + "dapo_7b_math_fsdp2_sglang_colocate.sh": SGLANG,
    O + "grpo_0.6b_gsm8k_fsdp2_sglang_2_6.sh": SGLANG,
    O + "grpo_0.6b_gsm8k_fsdp2_sglang_delta_sharded_2_6.sh": SGLANG,
}


def _dry_run(capsys, module: str, args: list[str]):
    from verl.experimental.async_policy.launch import main as async_main
    from verl.trainer.main_ppo import main as ppo_main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if module in MODES:
            code = async_main(MODES[module], [*args, "--cfg", "job"])
        else:
            assert module == "verl.trainer.main_ppo", module
            code = ppo_main([*args, "--cfg", "job"])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_data_file_covers_both_modes():
    modules = {e.get("module") for e in COMMANDS["commands"].values() if "error" not in e}
    assert set(MODES) <= modules
    assert COMMANDS["absent_folders"] == []
    assert set(EXPECTED) <= set(COMMANDS["commands"]), set(EXPECTED) - set(COMMANDS["commands"])


@pytest.mark.parametrize("script", sorted(COMMANDS["commands"]))
def test_upstream_async_script(capsys, script):
    entry = COMMANDS["commands"][script]
    expected = EXPECTED.get(script)
    if "error" in entry:  # the script did not reach an entry point under the stand-ins
        assert expected is not None and expected[1] in entry["error"], entry["error"]
        return
    code, out, err = _dry_run(capsys, entry["module"], entry["args"])
    if expected is None:
        assert code == 0, f"{script} is refused:\n{err}"
        cfg = yaml.safe_load(out)
        assert cfg["actor_rollout_ref"]["model"]["path"]
        if entry["module"] in MODES:  # a pool of its own for the rollout, and the engine the script names
            assert cfg["rollout"]["n_gpus_per_node"] >= 1
            assert f"actor_rollout_ref.rollout.name={cfg['actor_rollout_ref']['rollout']['name']}" in entry["args"]
        return
    kind, words = expected
    assert code == 2, f"{script} now composes: remove its EXPECTED entry ({kind}: {words})"
    assert words in err, err


def test_a_megatron_script_composes_on_the_megatron_config(capsys):
    """`--config-path=config --config-name=fully_async_ppo_megatron_trainer.yaml`: the path is relative to the
    entry point's folder (as Hydra reads it for upstream's fully_async_main.py), the config builds on
    ppo_megatron_trainer."""
    entry = COMMANDS["commands"][F + "grpo_30b_a3b_base_math_megatron_96_32.sh"]
    assert "--config-name=fully_async_ppo_megatron_trainer.yaml" in entry["args"]
    code, out, err = _dry_run(capsys, entry["module"], entry["args"])
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert cfg["async_training"]["partial_rollout"] is True and cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"


def test_count_of_scripts_that_compose(capsys):
    """Printed for the record (pytest -s); the per-script tests above are the assertions."""
    ok = [s for s, e in COMMANDS["commands"].items() if "error" not in e and EXPECTED.get(s) is None]
    kinds = [k for k, _ in EXPECTED.values()]
    with capsys.disabled():
        print(f"\n{len(ok)} of {len(COMMANDS['commands'])} upstream async scripts compose and validate; "
              f"declined: {kinds.count('declined')}, pending: {kinds.count('pending')}, "
              f"failing upstream too: {kinds.count('upstream')}")
    assert ok
