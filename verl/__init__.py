"""verl: RL post-training for LLMs (Qwen3.5 first).

Importing the package is kept cheap: torch/tensordict are only loaded when
``DataProto`` (or another heavy name) is first accessed, and Ray never here.
"""

import os

# Ray's automatic `uv run` runtime-env hook rewrites working_dir and breaks our explicit
# runtime envs; it must be off before Ray is imported anywhere. "1" re-enables it.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

_version_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "version", "version")
try:
    with open(_version_file) as _f:
        __version__ = _f.read().strip()
except OSError:  # e.g. a zipped install without data files
    __version__ = "0.0.0"

__all__ = ["DataProto", "__version__"]

# name -> (module, attribute), resolved on first access (PEP 562).
_LAZY = {
    "DataProto": ("verl.protocol", "DataProto"),
    "is_npu_available": ("verl.utils.device", "is_npu_available"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value  # cache: later lookups skip this hook
        return value
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
