"""Every key of the composed trainer configs is classified in key_status.txt, and each line's evidence holds.

A new key without a line fails here: add ``<key> <status> <evidence>`` (see the file's header). Lines for
``tested`` / ``used`` keys name a file that must mention the key; ``default-only`` / ``no-op`` / ``refused``
lines are probed through validation; ``pending`` keys are printed (another helper is implementing them).
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
from verl.trainer.config.key_status import load_key_status, status_for

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
def raw_keys(compose_fn):
    keys = {}
    for name in CONFIG_NAMES:
        for key, value in _leaves(OmegaConf.to_container(compose_fn(name), resolve=False)):
            keys.setdefault(key, value)
    return keys


def test_every_key_is_classified(raw_keys):
    missing = sorted(k for k in raw_keys if status_for(k) is None)
    assert not missing, "keys without a line in verl/trainer/config/key_status.txt:\n" + "\n".join(missing)


def test_no_stale_lines(raw_keys):
    stale = [e.pattern for e in load_key_status() if not any(e.matches(k) for k in raw_keys)]
    assert not stale, f"key_status.txt lines that match no config key: {stale}"


def _mentions(path: str, key: str) -> bool:
    file = REPO / path
    if not file.is_file():
        return False
    literal = [p for p in key.split(".") if not any(ch in p for ch in "*?[")]
    return literal[-1] in file.read_text() if literal else True


def test_tested_and_used_evidence_mentions_the_key(raw_keys):
    bad = []
    for key in raw_keys:
        entry = status_for(key)
        if entry and entry.status in ("tested", "used") and not _mentions(entry.evidence, key):
            bad.append(f"{key}: {entry.evidence}")
    assert not bad, "evidence files missing or not mentioning the key:\n" + "\n".join(bad)


def test_follows_points_at_a_classified_key(raw_keys):
    for key in raw_keys:
        entry = status_for(key)
        if entry and entry.status == "follows":
            value = str(raw_keys[key])
            assert value.startswith("${") and entry.evidence in value, (key, value, entry.evidence)
            assert status_for(entry.evidence) is not None or entry.evidence not in raw_keys, key


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
def demo_cfg(compose_fn):
    from verl.trainer.demo import register_resolver

    register_resolver()
    cfg = compose_fn("demo", ["actor_rollout_ref.model.path=/nonexistent", "data.train_files=x",
                              "data.val_files=x"])
    validate_config(cfg)  # the demo validates cleanly before any probe
    return cfg


def test_default_only_and_noop_defaults_match_the_yaml(raw_keys):
    for entry in load_key_status():
        if entry.status in ("default-only", "no-op") and entry.pattern in raw_keys:
            yaml_default = raw_keys[entry.pattern]
            assert entry.default() == yaml_default or (
                entry.default() in (None, {}, []) and yaml_default in (None, {}, [])), entry


@pytest.mark.parametrize("entry", [e for e in load_key_status() if e.status in ("default-only", "no-op")],
                         ids=lambda e: e.pattern)
def test_default_only_refused_and_noop_warns(entry, demo_cfg):
    cfg = copy.deepcopy(demo_cfg)
    OmegaConf.set_struct(cfg, False)
    if OmegaConf.select(cfg, entry.pattern, default="<absent>") == "<absent>":
        pytest.skip("not in the demo's (FSDP) config")
    OmegaConf.update(cfg, entry.pattern, _other_value(entry.default()), force_add=True)
    if entry.status == "default-only":
        with pytest.raises(ConfigValidationError) as info:
            validate_config(cfg)
        assert f"`{entry.pattern}`" in str(info.value)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            validate_config(cfg)
        assert any(issubclass(w.category, ConfigWarning) and entry.pattern in str(w.message) for w in caught)


def test_refused_probes(compose_fn):
    from verl.trainer.config import ConfigKeyError, compose_config

    for entry in [e for e in load_key_status() if e.status == "refused"]:
        with pytest.raises((ConfigKeyError, ConfigValidationError)) as info:
            compose_config("demo", [entry.evidence])
        assert entry.pattern.split("*")[0].rstrip(".") in str(info.value), entry


def test_pending_keys_are_listed(raw_keys, capsys):
    pending = sorted(k for k in raw_keys if (status_for(k) or None) and status_for(k).status == "pending")
    with capsys.disabled():
        print(f"\n[key status] {len(pending)} keys pending other helpers' work (see key_status.txt)")
    assert all(status_for(k).evidence for k in pending)


def test_docs_table_is_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "config_key_table.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
