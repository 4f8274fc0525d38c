"""The recipe/dapo scripts compose and validate as written (every key exists and the settings agree)."""

import re
import shlex
import warnings
from pathlib import Path

import pytest

from verl.trainer.config import validate_config
from verl.trainer.config.checks import compose_config

RECIPE = Path(__file__).resolve().parents[2] / "recipe" / "dapo"


def script_overrides(path: Path) -> tuple[str, list[str]]:
    """(config name, overrides) of the script's main_ppo command, with its shell defaults filled in."""
    text = path.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, flags=re.M))
    defaults["HOME"] = "/tmp/home"
    defaults["STEPS"] = "5"
    # From the module on: the interpreter is the script's "$PYTHON" (tests/test_docs_commands.py checks it).
    command = text[text.index("-m verl.trainer.main_ppo"):].replace("\\\n", " ")
    command = command.split("\n")[0].replace('"$@"', "")
    command = re.sub(r"\$\(\(.*?\)\)", "10240", command)
    command = re.sub(r"\$\{(\w+)(:-[^}]*)?\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(3), "x"), command)
    args = shlex.split(command)[2:]
    name = "ppo_trainer"
    if args[:1] == ["--config-name"]:
        name, args = args[1], args[2:]
    return name, args


@pytest.mark.parametrize("script", sorted(p.name for p in RECIPE.glob("*.sh")))
def test_recipe_composes_and_validates(script):
    name, overrides = script_overrides(RECIPE / script)
    assert any(o.startswith("algorithm.filter_groups.enable=True") for o in overrides)
    cfg = compose_config(name, overrides, validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate_config(cfg)
    assert cfg.reward.reward_manager.name == "dapo"
    assert cfg.actor_rollout_ref.actor.clip_ratio_high > cfg.actor_rollout_ref.actor.clip_ratio_low
