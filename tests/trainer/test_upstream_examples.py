"""Upstream verl's own example scripts, as a verl user would start them, through ``main_ppo ... --cfg job``
(issue 27's done-when).

The scripts themselves are upstream's and are not shipped here: ``scripts/extract_upstream_commands.py`` ran
each ``*.sh`` of the example folders a Qwen3.5 user starts from (grpo, dapo, gspo, sapo, rollout correction,
LoRA, profiling, and the otb / gdpo / prefix-grouper folders) under stand-in commands and wrote the argument
list each hands to ``verl.trainer.main_ppo`` to ``tests/trainer/data/upstream_example_commands.json``
(upstream's commit is recorded there; rerun the script on a newer checkout to refresh it).

Every script either composes and validates, or is refused for the reason listed in ``EXPECTED``, exactly:
a script that starts to compose fails here until its entry is removed, so the table stays true.
* ``declined``: an engine or feature this project leaves out on purpose (VeOmni, Megatron-lite, FSDP-Turbo,
  SGLang, Megatron-FSDP); refused in one sentence.
* ``pending``: an upstream key issue 27 names that is built elsewhere (its part A) or not yet.
* ``rule``: a setting this project's validation refuses on its own grounds (given with the rule).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Optional

import pytest
import yaml

from verl.trainer.main_ppo import main

DATA = Path(__file__).parent / "data" / "upstream_example_commands.json"
COMMANDS = json.loads(DATA.read_text())

VEOMNI = ("declined", "`model_engine=veomni` is not an option of the config group `model_engine` (veomni selects "
                      "the VeOmni training engine, which this project does not implement)")
MLITE = ("declined", "`actor=mlite_actor` is not an option of the config group `actor` (mlite_actor selects the "
                     "Megatron-lite training engine")
TURBO = ("declined", "more key(s) of the same command belong to FSDP-Turbo (Huawei's fsdp_turbo training engine")
# tool=npu needs torch_npu: refused on a host without it, composes on an Ascend host
NPU_HOST = (None if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") else
            ("rule", "`global_profiler.tool` is 'npu' (the Ascend profiler, torch_npu.profiler), but torch_npu is not "
                     "installed here"))
# The Qwen3.5 Megatron scripts (35B, 122B-A10B, 397B) compose: their MindSpeed arguments use_flash_attn and
# use_naive_l2norm are applied (config_fields.APPLIED_EXTRAS), their TP=2 PP=2 EP=8 ETP=1 layout is accepted since
# ranks are laid out pipeline-outermost.
MICRO = ("rule", "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` (8) must divide the per-GPU mini-batch (4")

G = "examples/grpo_trainer/"
# Upstream's context-parallel Megatron scripts (run_hy_v3_megatron.sh, the Qwen3-VL 30B / 235B ones) compose since
# context_parallel_size > 1 is built (Qwen3.5 local spec); a model without a Megatron entry is refused where its
# config.json is readable (validation) or when the engine starts.
EXPECTED: dict[str, Optional[tuple[str, str]]] = {
    # Its R3 keys compose (megatron.router_replay.mode=R3 with vLLM recording the routes through
    # enable_return_routed_experts); what stays refused are two DeepSeek-V4 fields megatron-core 0.19.2's
    # TransformerConfig lacks (DeepSeek-V4 itself has no Megatron model here either).
    G + "run_deepseek_v4_flash_megatron.sh": ("rule", "apply_dsa_kernel_fusion is not a field of megatron-core's "
                                                      "TransformerConfig"),
    G + "run_deepseek_v4_megatron_lite.sh": ("declined", "no verl.trainer.main_ppo launch"),  # points to Megatron-LM
    G + "run_deepseek_v4_veomni.sh": VEOMNI,
    # `+...fsdp_config.model_dtype=bfloat16` on a key upstream's own config has (model_dtype: fp32): Hydra 1.3 refuses
    # `+` on a non-null key, and upstream's ppo_trainer composed with Hydra 1.3 refuses this script the same way
    # ("Could not append to config"); `...model_dtype=bfloat16` or `++...` works in both. (Then: rollout.name=sglang.)
    G + "run_gpt_oss_20b_fsdp.sh": ("rule", "`actor_rollout_ref.actor.fsdp_config.model_dtype` already exists"),
    G + "run_kimi_k2_6_glm5_1_megatron_lite.sh": MLITE,
    G + "run_qwen2-7b_math_megatron_fsdp.sh": ("declined", "is not supported: Megatron-FSDP is left out on "
                                                           "purpose"),
    # ETP unset means ETP = TP = 4: 4 * EP 2 * PP 2 = 16 ranks per expert replica on 8 GPUs (megatron-core's
    # initialize_model_parallel raises the same; upstream's script needs expert_tensor_parallel_size=1)
    G + "run_qwen3_30b_a3b_megatron.sh": ("rule", "expert_model_parallel_size` * expert_tensor_parallel_size * "
                                                  "pipeline_model_parallel_size (2 * 4 * 2) must divide the world "
                                                  "size (8)"),
    G + "run_qwen3_30b_veomni.sh": VEOMNI,
    G + "run_qwen3_5-122b-a10b_veomni.sh": VEOMNI,
    G + "run_qwen3_5_27b_fsdp_turbo.sh": TURBO,
    G + "run_qwen3_5_35b_a3b_veomni.sh": VEOMNI,
    G + "run_qwen3_5_35b_fsdp_turbo.sh": TURBO,
    G + "run_qwen3_5_35b_megatron_lite.sh": MLITE,
    G + "run_qwen3_vl_30b_moe_veomni.sh": VEOMNI,
    # upstream's own worker asserts the same (mini-batch 32 * n 1 / 8 GPUs = 4 rows per GPU, micro-batches of 8)
    "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh": MICRO,
    "examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh": MICRO,
    "examples/profile/run_qwen2_5_vl_7b_torch_memory.sh": ("declined", "`actor_rollout_ref.rollout.name` is 'sglang', "
                                                                       "which selects the SGLang rollout engine"),
    "examples/profile/run_qwen3_8b_npu_profile_discrete.sh": NPU_HOST,  # npu.discrete itself is built
    "examples/profile/run_qwen3_8b_npu_profile_e2e.sh": NPU_HOST,
    "examples/prefix_grouper/run_qwen3_8b_fsdp.sh": ("declined", "`actor_rollout_ref.actor.use_prefix_grouper` is "
                                                                 "true, but the shared-prefix forward is not "
                                                                 "implemented"),
}


def _dry_run(capsys, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([*args, "--cfg", "job"])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_data_file_covers_the_folders_the_issue_names():
    folders = {Path(script).parts[1] if "tuning" not in script else "tuning/lora" for script in COMMANDS["commands"]}
    assert {"grpo_trainer", "gspo_trainer", "sapo_trainer", "rollout_correction", "tuning/lora", "profile"} <= folders
    # upstream keeps DAPO in its recipe repository now; the extraction records the folder as absent
    assert COMMANDS["absent_folders"] == ["dapo_trainer"]
    assert set(EXPECTED) <= set(COMMANDS["commands"]), set(EXPECTED) - set(COMMANDS["commands"])


@pytest.mark.parametrize("script", sorted(COMMANDS["commands"]))
def test_upstream_example_script(capsys, script):
    entry = COMMANDS["commands"][script]
    expected = EXPECTED.get(script)
    if "error" in entry:  # the script did not reach main_ppo under the stand-ins
        assert expected is not None and expected[1] in entry["error"], entry["error"]
        return
    code, out, err = _dry_run(capsys, entry["args"])
    if expected is None:
        assert code == 0, f"{script} is refused:\n{err}"
        assert yaml.safe_load(out)["actor_rollout_ref"]["model"]["path"]
        return
    kind, words = expected
    assert code == 2, f"{script} now composes: remove its EXPECTED entry ({kind}: {words})"
    assert words in err, err
    if kind == "declined":  # one clear sentence, not a list of key errors
        text = err.strip()
        assert len(text.splitlines()) <= 3 and "Traceback" not in text, text


def test_count_of_scripts_that_compose(capsys):
    """Printed for the record (pytest -s); the per-script tests above are the assertions."""
    refused = [e for e in EXPECTED.values() if e is not None]
    ok = [s for s, e in COMMANDS["commands"].items() if "error" not in e and EXPECTED.get(s) is None]
    print(f"{len(ok)} of {len(COMMANDS['commands'])} upstream example scripts compose and validate; "
          f"declined: {sum(k == 'declined' for k, _ in refused)}, "
          f"pending: {sum(k == 'pending' for k, _ in refused)}, "
          f"refused by a rule: {sum(k == 'rule' for k, _ in refused)}")
    assert ok


@pytest.mark.parametrize("script", ["examples/profile/run_qwen3_8b_npu_profile_discrete.sh",
                                    "examples/profile/run_qwen3_8b_npu_profile_e2e.sh"])
def test_npu_profile_scripts_compose_where_torch_npu_imports(capsys, monkeypatch, script):
    """The Ascend scripts' only refusal here is the missing torch_npu (NPU_HOST): with a stand-in module
    importable, both compose (tool_config.npu.discrete included)."""
    import importlib.machinery
    import types

    stand_in = types.ModuleType("torch_npu")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    code, out, err = _dry_run(capsys, COMMANDS["commands"][script]["args"])
    assert code == 0, err
    assert yaml.safe_load(out)["actor_rollout_ref"]["actor"]["profiler"]["tool_config"]["npu"]["discrete"] is (
        "discrete" in script)


def test_qwen3_5_35b_megatron_layout_composes_without_the_mindspeed_overrides(capsys):
    """TP=2 PP=2 EP=8 ETP=1 on 16 GPUs (upstream's own 35B script): only the two MindSpeed-only overrides keep it
    from composing; the parallel layout itself validates."""
    args = COMMANDS["commands"][G + "run_qwen3_5_35b_megatron.sh"]["args"]
    kept = [a for a in args if "use_flash_attn" not in a and "use_naive_l2norm" not in a]
    assert len(kept) == len(args) - 2  # the ref section follows the actor's
    code, out, err = _dry_run(capsys, kept)
    assert code == 0, err
    meg = yaml.safe_load(out)["actor_rollout_ref"]["actor"]["megatron"]
    assert (meg["pipeline_model_parallel_size"], meg["expert_model_parallel_size"]) == (2, 8)
