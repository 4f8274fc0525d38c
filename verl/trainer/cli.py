"""The trainer's command line, as Hydra's would read it for ``main_ppo.py``.

* ``--config-path`` / ``-cp`` is absolute, ``pkg://package.path``, or relative to the directory of the
  main module (``verl/trainer/``), exactly as Hydra resolves it; ``--config-name`` / ``-cn`` names a YAML
  file there (``.yaml`` optional). A config in a user's folder may build on this project's configs
  (``defaults: [ppo_trainer, _self_]``): the project's config folder is always on the search path.
* ``--cfg job`` (or ``all``) prints the composed, validated config and runs nothing; ``--resolve``
  resolves interpolations first and ``--package KEY`` prints one subtree.
* ``--help`` lists the configs, the config groups and their options.
* With no ``--config-name`` and no model path among the overrides, the embedded demo config is the base:
  a bare ``python -m verl.trainer.main_ppo trainer.total_training_steps=5`` runs the demo with that override.

Errors the user fixes (config keys, values, missing configs or groups, data, reward functions, model
paths) are printed as one paragraph with a non-zero exit; ``VERL_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Optional

__all__ = ["CliArgs", "parse_args", "help_text", "format_error", "MODEL_PATH_KEY"]

MAIN_MODULE_DIR = Path(__file__).resolve().parent  # where main_ppo.py lives: Hydra's base for --config-path
MODEL_PATH_KEY = "actor_rollout_ref.model.path"

_FLAGS_WITH_VALUE = {
    "--config-name": "config_name", "-cn": "config_name",
    "--config-path": "config_path", "-cp": "config_path",
    "--cfg": "cfg", "-c": "cfg",
    "--package": "package", "-p": "package",
}


class CliError(ValueError):
    """A malformed command line (a flag without its value, an unknown --cfg kind)."""


@dataclasses.dataclass
class CliArgs:
    config_name: str
    config_dir: Optional[Path]  # None: this project's config folder
    overrides: list[str]
    cfg: Optional[str] = None  # "job" / "all": print the config and stop
    resolve: bool = False
    package: Optional[str] = None
    help: bool = False
    demo_fallback: bool = False  # the demo was chosen because no model path was given


def resolve_config_path(value: str, main_dir: Path = MAIN_MODULE_DIR) -> Path:
    """``--config-path`` as Hydra reads it for a main module in ``main_dir`` (``verl/trainer/``; an asynchronous
    mode's entry point passes its own package's folder, where upstream's scripts find ``config``)."""
    if value.startswith("pkg://"):
        package = value[len("pkg://"):].replace("/", ".")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CliError(f"--config-path={value!r}: no importable package {package!r}.")
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    if value.startswith("file://"):
        value = value[len("file://"):]
    path = Path(value).expanduser()
    return (path if path.is_absolute() else main_dir / path).resolve()


def _shown(folder: Path) -> str:
    """A folder of this package as a reader finds it (``verl/trainer``), else as it is."""
    root = MAIN_MODULE_DIR.parents[1]
    return str(folder.relative_to(root)) if folder.is_relative_to(root) else str(folder)


def _sets_model_path(overrides: list[str]) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == MODEL_PATH_KEY for o in overrides)


def parse_args(argv: list[str], main_dir: Path = MAIN_MODULE_DIR) -> CliArgs:
    """``main_dir``: the entry point's folder, the base of a relative ``--config-path``."""
    values: dict[str, str] = {}
    rest: list[str] = []
    resolve = show_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag in _FLAGS_WITH_VALUE and arg.startswith("-"):
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise CliError(f"{flag} needs a value.")
            values[_FLAGS_WITH_VALUE[flag]] = value
        elif arg == "--resolve":
            resolve = True
        elif arg in ("--help", "-h", "--hydra-help"):
            show_help = True
        else:
            rest.append(arg)
        i += 1
    cfg = values.get("cfg")
    if cfg is not None and cfg not in ("job", "all", "hydra"):
        raise CliError(f"--cfg={cfg!r}: use job (the training config), all, or hydra.")
    config_dir = resolve_config_path(values["config_path"], main_dir) if "config_path" in values else None
    if config_dir is not None and not config_dir.is_dir():
        raise CliError(f"--config-path={values['config_path']!r} resolves to {config_dir}, which is not a folder "
                       f"(a relative --config-path is relative to {_shown(main_dir)}/, as Hydra resolves it).")
    name = values.get("config_name")
    demo_fallback = False
    if name is None:
        # No config named and no model named: the embedded demo, with the given overrides applied on top.
        demo_fallback = config_dir is None and not _sets_model_path(rest)
        name = "demo" if demo_fallback else "ppo_trainer"
    if name.endswith((".yaml", ".yml")):
        name = name.rsplit(".", 1)[0]
    return CliArgs(config_name=name, config_dir=config_dir, overrides=rest, cfg=cfg, resolve=resolve,
                   package=values.get("package"), help=show_help, demo_fallback=demo_fallback and bool(rest))


def _group_options(config_dir: Path) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for sub in sorted(p for p in config_dir.iterdir() if p.is_dir() and not p.name.startswith("_")):
        options = sorted(f.stem for f in sub.glob("*.yaml"))
        if options:
            groups[sub.name] = options
    return groups


_PPO_ABOUT = (
    "PPO / GRPO training with verl's config keys. With no actor_rollout_ref.model.path (and no",
    "--config-name) the embedded demo runs: a tiny Qwen3.5 learning the letter-echo task on one CPU,",
    "with your overrides applied.",
)


def help_text(config_dir: Optional[Path] = None, module: str = "verl.trainer.main_ppo",
              about: tuple[str, ...] = _PPO_ABOUT) -> str:
    """``--help`` of a trainer entry point: usage, what it does (``about``), the configs and config groups."""
    from verl.trainer.config import CONFIG_DIR

    dirs = [d for d in (config_dir, CONFIG_DIR) if d is not None]
    configs = sorted({f.stem for d in dirs if d.is_dir() for f in d.glob("*.yaml")})
    groups: dict[str, list[str]] = {}
    for d in reversed(dirs):
        if d.is_dir():
            groups.update(_group_options(d))
    usage = f"usage: python -m {module} "
    lines = [
        usage + "[--config-path DIR] [--config-name NAME]",
        " " * len(usage) + "[--cfg job [--resolve] [--package KEY]] [key=value ...]",
        "",
        *about,
        "",
        "--config-path DIR   absolute, pkg://package, or relative to verl/trainer/ (as Hydra resolves it)",
        "--config-name NAME  " + ", ".join(configs),
        "--cfg job           print the composed, validated config and exit (--resolve: resolve it first;",
        "                    --package KEY: print only that subtree)",
        "",
        "== Configuration groups ==",
        "Compose your configuration from those groups (group=option)",
        "",
    ]
    lines += [f"{group}: {', '.join(options)}" for group, options in groups.items()]
    lines += [
        "",
        "== Overrides ==",
        "key=value sets a key; +key=value adds one below a free-form node (override_config, engine_kwargs.*,",
        "ray_kwargs.ray_init, ...), sets a null key, or merges a list/dict value into an existing key (Hydra's",
        "rule); ++key=value adds or sets; ~key deletes. Unknown keys",
        "are refused with the nearest valid key. Key reference: docs/concepts/config.md.",
    ]
    return "\n".join(lines)


def format_error(exc: BaseException) -> Optional[tuple[str, int]]:
    """``(text, exit code)`` for an error the user fixes, or None for a bug (shown with its traceback)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    from verl.trainer.config import ConfigKeyError, ConfigValidationError
    from verl.utils.user_errors import UserFacingError

    if isinstance(exc, (ConfigKeyError, ConfigValidationError)):
        return f"Config error:\n{exc}", 2
    if isinstance(exc, CliError):
        return f"Config error: {exc}", 2
    if isinstance(exc, MissingConfigException):
        return _missing_config_text(exc), 2
    if isinstance(exc, OverrideParseException):
        return f"Config error: could not parse the overrides: {str(exc).splitlines()[0]}", 2
    if isinstance(exc, HydraException):
        first = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        return f"Config error: {first}", 2
    if isinstance(exc, UserFacingError):
        # A config mistake found only at run time (a token budget below the longest row) exits like the others.
        return exc.paragraph(), 2 if exc.kind == "Config" else 1
    return None


def report_user_error(exc: BaseException) -> Optional[int]:
    """Print a user's error as its one paragraph and return the exit code; None when the caller must re-raise
    (a bug, or ``VERL_DEBUG=1`` asking for the traceback). One place for main_ppo and sft_trainer."""
    from verl.utils.user_errors import debug_enabled

    formatted = format_error(exc)
    if formatted is None or debug_enabled():
        return None
    text, code = formatted
    print(text, file=sys.stderr, flush=True)
    return code


def _missing_config_text(exc) -> str:
    from verl.trainer.config.unsupported import feature_for_group

    message = str(exc).splitlines()[0]
    missing = getattr(exc, "missing_cfg_file", None) or ""
    options = list(getattr(exc, "options", None) or [])
    if "/" in missing:  # a config-group option
        group, _, choice = missing.rpartition("/")
        text = f"Config error: `{group}={choice}` is not an option of the config group `{group}`"
        feature = feature_for_group(group, choice)
        if feature:
            text += f" ({choice} selects {feature}, which this project does not implement)"
        if options:
            text += f"; its options are {', '.join(options)}"
        return text + ". See `python -m verl.trainer.main_ppo --help` for every group."
    text = f"Config error: {message.rstrip('.')}."
    return text + (" Pass --config-name with a YAML file of the --config-path folder (a relative --config-path "
                   "is relative to the entry point's folder, verl/trainer/ for main_ppo, as in Hydra); `--help` "
                   "lists the configs.")


def print_config(cfg, args: CliArgs) -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, args.package) if args.package else cfg
    if node is None:
        raise CliError(f"--package {args.package!r} is not a key of the composed config.")
    if args.cfg == "hydra":
        print("# This trainer composes its config with Hydra's compose API; it has no Hydra runtime config.")
        return
    if not OmegaConf.is_config(node):
        print(node)
        return
    sys.stdout.write(OmegaConf.to_yaml(node, resolve=args.resolve))
