"""Every key of the composed trainer configs is classified in key_status.txt, and each line's evidence holds.

A new key without a line fails here: add ``<key> <status> <evidence>`` (see the file's header). A ``tested``
line must name a test file under tests/ that names the key by the header's rule (``keys_named_in``);
``default-only`` / ``no-op`` / ``refused`` lines are probed through validation; ``follows`` lines must be
interpolations; the retired statuses ``used`` / ``pending`` fail.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_DIR, ConfigValidationError, ConfigWarning, validate_config
from verl.trainer.config.key_status import (
    RETIRED_STATUSES,
    STATUSES,
    KeyStatus,
    keys_named_in,
    load_key_status,
    segments_to_name,
    status_for,
)

REPO = Path(__file__).resolve().parents[3]
CONFIG_NAMES = [n for n in ("ppo_trainer", "ppo_megatron_trainer", "sft_trainer_engine")
                if (CONFIG_DIR / f"{n}.yaml").exists()]


def _leaves(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _leaves(value, path)
        else:
            yield path, value


@pytest.fixture(scope="module")
def keys_by_config(compose_fn):
    return {name: dict(_leaves(OmegaConf.to_container(compose_fn(name), resolve=False))) for name in CONFIG_NAMES}


@pytest.fixture(scope="module")
def raw_keys(keys_by_config):
    keys = {}
    for name in CONFIG_NAMES:
        for key, value in keys_by_config[name].items():
            keys.setdefault(key, value)
    return keys


def test_every_key_is_classified(raw_keys):
    missing = sorted(k for k in raw_keys if status_for(k) is None)
    assert not missing, "keys without a line in verl/trainer/config/key_status.txt:\n" + "\n".join(missing)


def test_no_stale_lines(raw_keys):
    stale = [e.pattern for e in load_key_status() if not any(e.matches(k) for k in raw_keys)]
    assert not stale, f"key_status.txt lines that match no config key: {stale}"


def test_no_key_is_only_read_or_pending(raw_keys):
    # "read by code, no test" and "being implemented" are what this walk exists to rule out
    left = sorted(f"{k}: {status_for(k).status} {status_for(k).evidence}" for k in raw_keys
                  if status_for(k) is not None and status_for(k).status in RETIRED_STATUSES)
    assert not left, ("keys that are neither tested nor refused; write a test that sets the key and checks its "
                      "effect, or make it default-only / no-op / follows:\n" + "\n".join(left))


# ------------------------------------------------------------------------------------------ the naming rule
KEYS = ["actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "optim.lr", "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "actor_rollout_ref.rollout.nnodes", "trainer.nnodes", "model_engine",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu"]


@pytest.mark.parametrize("text, named", [
    ('"actor_rollout_ref.actor.optim.lr=1e-3"', {"actor_rollout_ref.actor.optim.lr"}),
    ("cfg.critic.optim.lr = 2", {"critic.optim.lr"}),  # the critic's key only
    ('f"{role}.optim.lr=1"', {"actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "optim.lr"}),
    ("lr = 3; optim_lr = 4", set()),  # one segment of a short name names nothing
    ('"actor_rollout_ref.actor.optim.lr_warmup_steps=2"', {"actor_rollout_ref.actor.optim.lr_warmup_steps"}),
    ('"trainer.nnodes=2"', {"trainer.nnodes"}),  # not rollout.nnodes
    ('strategy="PACK"', set()),
    ("model_engine=megatron", {"model_engine"}),
    ("update_weights_bucket_megabytes=64", {"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"}),
    ("ppo_micro_batch_size_per_gpu=2", set()),  # long, but ends two keys: needs its section
    ("actor.ppo_micro_batch_size_per_gpu=2", {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"}),
])
def test_naming_rule(text, named):
    assert keys_named_in(text, KEYS) == named


def test_segments_to_name():
    assert segments_to_name("model_engine", KEYS) == 1
    assert segments_to_name("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes", KEYS) == 1
    assert segments_to_name("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", KEYS) == 2
    assert segments_to_name("actor_rollout_ref.actor.optim.lr", KEYS) == 2


def test_tested_evidence_is_a_test_file_that_names_the_key(raw_keys):
    named: dict[str, set] = {}
    bad = []
    for key in sorted(raw_keys):
        entry = status_for(key)
        if entry is None or entry.status != "tested":
            continue
        path = Path(entry.evidence)
        file = REPO / path
        if path.parts[:1] != ("tests",) or not path.name.startswith("test_") or path.suffix != ".py" \
                or not file.is_file():
            bad.append(f"{key}: {entry.evidence} is not a test file under tests/")
            continue
        if entry.evidence not in named:
            named[entry.evidence] = keys_named_in(file.read_text(), raw_keys)
        if key not in named[entry.evidence]:
            bad.append(f"{key}: {entry.evidence} does not name it (see the rule in key_status.txt's header)")
    assert not bad, "tested keys whose evidence fails:\n" + "\n".join(bad)


def test_follows_points_at_a_classified_key(raw_keys):
    for key in raw_keys:
        entry = status_for(key)
        if entry and entry.status == "follows":
            value = str(raw_keys[key])
            assert value.startswith("${") and entry.evidence in value, (key, value, entry.evidence)
            assert status_for(entry.evidence) is not None or entry.evidence not in raw_keys, key


# ------------------------------------------------------------------------------------------ probes
def _other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "_x"
    if value in (None, {}, []):
        return 1
    return None


@pytest.fixture(scope="module")
def probe_cfgs(compose_fn):
    """A config that validates cleanly for each family of keys: the demo (PPO on FSDP), the demo on Megatron
    sections, and an SFT config."""
    from verl.trainer.demo import register_resolver

    register_resolver()
    demo = compose_fn("demo", ["actor_rollout_ref.model.path=/nonexistent", "data.train_files=x", "data.val_files=x"])
    validate_config(demo)  # the demo validates cleanly before any probe
    megatron = compose_fn("demo", ["actor_rollout_ref.model.path=/nonexistent", "data.train_files=x",
                                   "data.val_files=x", "model_engine=megatron"])
    from verl.trainer.sft_trainer import compose_sft_config

    sft, strategy = compose_sft_config(["model.path=/m", "data.train_files=x", "trainer.device=cpu"])
    return {"demo": demo, "megatron": megatron, "sft": (sft, strategy)}


def _problems_and_warnings(probe_cfgs, which, cfg):
    """(problem text, warning texts) of validating ``cfg`` as config family ``which``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if which == "sft":
                from verl.trainer.sft_trainer import validate_sft_config

                validate_sft_config(cfg, probe_cfgs["sft"][1])
            else:
                validate_config(cfg)
            text = ""
        except ConfigValidationError as err:
            text = str(err)
    return text, [str(w.message) for w in caught if which == "sft" or issubclass(w.category, ConfigWarning)]


def _family(probe_cfgs, key):
    for which in ("demo", "megatron", "sft"):
        cfg = probe_cfgs[which][0] if which == "sft" else probe_cfgs[which]
        if OmegaConf.select(cfg, key, default="<absent>") != "<absent>":
            return which, cfg
    return None, None


def test_default_only_and_noop_defaults_match_the_yaml(raw_keys):
    for entry in load_key_status():
        if entry.status in ("default-only", "no-op") and entry.pattern in raw_keys:
            yaml_default = raw_keys[entry.pattern]
            assert entry.default() == yaml_default or (
                entry.default() in (None, {}, []) and yaml_default in (None, {}, [])), entry


@pytest.mark.parametrize("entry", [e for e in load_key_status() if e.status in ("default-only", "no-op")],
                         ids=lambda e: e.pattern)
def test_default_only_refused_and_noop_warns(entry: KeyStatus, probe_cfgs):
    which, base = _family(probe_cfgs, entry.pattern)
    if which is None:
        pytest.skip("in none of the probe configs")
    if which == "sft" and entry.pattern.startswith("data."):
        pytest.skip("the SFT trainer's data.* keys are its own (PPO's data section is probed on the demo)")
    cfg = copy.deepcopy(base)
    OmegaConf.set_struct(cfg, False)
    OmegaConf.update(cfg, entry.pattern, _other_value(entry.default()), force_add=True)
    before, before_warnings = _problems_and_warnings(probe_cfgs, which, copy.deepcopy(base))
    text, warned = _problems_and_warnings(probe_cfgs, which, cfg)
    if entry.status == "default-only":
        assert f"`{entry.pattern}`" in text and f"`{entry.pattern}`" not in before, (which, text)
    else:
        assert any(entry.pattern in w for w in warned) and not any(entry.pattern in w for w in before_warnings)


def test_refused_probes():
    from verl.trainer.config import ConfigKeyError, compose_config
    from verl.trainer.demo import register_resolver

    register_resolver()
    for entry in [e for e in load_key_status() if e.status == "refused"]:
        overrides = entry.evidence.split()
        with pytest.raises((ConfigKeyError, ConfigValidationError)) as info:
            compose_config("demo", overrides)
        assert entry.pattern.split("*")[0].rstrip(".") in str(info.value), entry
        # the probe's own key is the trouble: the demo with the other overrides alone composes
        rest = [o for o in overrides if not o.startswith(entry.pattern.split("*")[0].rstrip("."))]
        compose_config("demo", rest)


def test_statuses_are_the_documented_ones():
    assert STATUSES == ("tested", "refused", "default-only", "no-op", "follows")
    assert all(e.status in STATUSES + RETIRED_STATUSES for e in load_key_status())


def test_docs_table_is_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "config_key_table.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
