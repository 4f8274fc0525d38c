#!/usr/bin/env bash
# One-shot, idempotent set-up of the project's virtual environment at <repo>/.venv.
#
#   bash scripts/setup.sh
#
# 1. creates .venv with `python3 -m venv` (PYTHON=... picks another interpreter) unless it already exists;
# 2. installs torch==2.13.0 (the CPU build on a CPU machine) only if torch is not importable in .venv yet;
# 3. installs this repository in editable mode with its test extra: pip install -e ".[test]", constrained to
#    constraints.txt: the versions the suite last passed with (scripts/update_constraints.sh moves them on;
#    NO_CONSTRAINTS=1 installs the newest versions requirements.txt allows instead).
#
# torch is kept exactly as found (or as just installed) through step 3 by a pip constraint, so no dependency
# can swap it for a CUDA build. Plain pip is used throughout, so mirrors configured for pip on the machine
# (pip.conf, PIP_INDEX_URL, PIP_FIND_LINKS, ...) apply. flash-linear-attention / triton are never installed
# here: on a CPU machine they break every Qwen3.5 forward (see the `gpu` extra in setup.py instead).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY_BASE="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
PIP_QUIET=(-q)
[[ "${VERBOSE:-0}" == "1" ]] && PIP_QUIET=()

say() { printf '[setup] %s\n' "$*"; }
start=$SECONDS

if [[ -x "$VENV/bin/python" ]]; then
    say "using existing virtual environment $VENV"
else
    command -v "$PY_BASE" >/dev/null 2>&1 || { say "ERROR: '$PY_BASE' not found; install Python >= 3.10 or set PYTHON=/path/to/python3"; exit 1; }
    "$PY_BASE" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
        || { say "ERROR: $("$PY_BASE" --version 2>&1) is too old; Python >= 3.10 is required (set PYTHON=...)"; exit 1; }
    say "creating virtual environment $VENV with $("$PY_BASE" --version 2>&1)"
    "$PY_BASE" -m venv "$VENV"
fi

PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

if "$PY" -c 'import torch' >/dev/null 2>&1; then
    say "torch already present: $("$PY" -c 'import torch; print(torch.__version__)') (left untouched)"
else
    say "installing $TORCH_SPEC (resolves to the CPU wheel on a CPU machine)"
    "${PIP[@]}" install ${PIP_QUIET[@]+"${PIP_QUIET[@]}"} "$TORCH_SPEC"
fi

# Pin whatever torch is now installed for the rest of the install.
TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
if [[ "${NO_CONSTRAINTS:-0}" != "1" ]]; then
    cat "$ROOT/constraints.txt" >> "$CONSTRAINTS"
    say "pinning dependencies to constraints.txt (the versions the suite last passed with)"
fi

say "installing verl (editable) with the test extra: pip install -e \".[test]\""
"${PIP[@]}" install ${PIP_QUIET[@]+"${PIP_QUIET[@]}"} -c "$CONSTRAINTS" -e "${ROOT}[test]"

# fla + triton on a CPU box make transformers pick Triton kernels that fail on CPU: warn if something has them.
if "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("fla") else 1)' 2>/dev/null \
   && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    say "WARNING: flash-linear-attention (fla) is installed but no GPU is visible; Qwen3.5 CPU forwards will fail."
    say "         remove it with: $PY -m pip uninstall -y flash-linear-attention fla-core"
fi

say "done in $((SECONDS - start))s: torch $TORCH_VERSION, $("$PY" -c 'import verl; print("verl", verl.__version__)' 2>/dev/null || echo 'verl installed')"
say "next: .venv/bin/python -m verl.trainer.main_ppo   (demo)   |   .venv/bin/python -m pytest -q   (tests)"
