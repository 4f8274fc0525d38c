"""Which keys ``*.megatron.override_transformer_config`` and ``override_ddp_config`` accept: the fields of
megatron-core's ``TransformerConfig`` and ``DistributedDataParallelConfig``, as upstream passes them through.

Where megatron-core is importable the live dataclasses answer. Elsewhere (config validation on a machine without
it: megatron-core needs Python >= 3.12 and CUDA) the answer is ``mcore_config_fields.txt``, the fields read from
megatron-core's source by ``scripts/mcore_config_fields.py`` (its header names the version), so a misspelt field
is refused before any worker starts either way.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path

__all__ = ["APPLIED_EXTRAS", "TRANSFORMER_CONFIG", "DDP_CONFIG", "config_fields", "unknown_fields"]

TRANSFORMER_CONFIG = "TransformerConfig"
DDP_CONFIG = "DistributedDataParallelConfig"
_FIELDS_FILE = Path(__file__).with_name("mcore_config_fields.txt")

# Names upstream's Qwen3.5 Megatron scripts set that are MindSpeed / megatron.training arguments, not megatron-core
# fields, and that this project applies itself (``verl.models.mcore.config_converter.EXTRA_MODEL_KEYS`` keeps them
# on the TransformerConfig object for the model to read).
APPLIED_EXTRAS = {
    "use_naive_l2norm": "q/k L2 norm of the Gated DeltaNet in plain torch before the delta-rule kernel, instead of "
                        "inside it",
    "use_flash_attn": "MindSpeed's flash-attention switch; packed full attention here already runs a varlen flash "
                      "kernel on CUDA in bf16/fp16 (a warning says the key changes nothing)",
}

# Names upstream scripts set that are not megatron-core fields and are not applied here: the error says why.
_NOT_MCORE = {
    "use_triton_gdn": "a MindSpeed (Megatron on Ascend) option, which this project does not implement",
    "use_ascend_gdn": "a MindSpeed (Megatron on Ascend) option, which this project does not implement",
}


def _live(kind: str):
    if kind == TRANSFORMER_CONFIG:
        from megatron.core.transformer import TransformerConfig as cls
    else:
        from megatron.core.distributed import DistributedDataParallelConfig as cls
    return frozenset(f.name for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _from_file() -> dict[str, frozenset[str]]:
    sections: dict[str, set[str]] = {}
    current = None
    for line in _FIELDS_FILE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], set())
        elif current is not None:
            current.add(line)
    return {k: frozenset(v) for k, v in sections.items()}


@functools.lru_cache(maxsize=None)
def config_fields(kind: str) -> frozenset[str]:
    """The dataclass fields of megatron-core's ``kind`` (TRANSFORMER_CONFIG or DDP_CONFIG)."""
    try:
        return _live(kind)
    except ImportError:
        return _from_file()[kind]


def unknown_fields(values, kind: str, key: str) -> list[str]:
    """One problem per key of the mapping ``values`` that ``kind`` lacks, naming ``<key>.<field>``."""
    known = config_fields(kind) | (frozenset(APPLIED_EXTRAS) if kind == TRANSFORMER_CONFIG else frozenset())
    problems = []
    for name in sorted(set(values) - known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f"; did you mean `{close[0]}`?" if close else "; remove it."
        where = f" ({_NOT_MCORE[name]})" if name in _NOT_MCORE else ""
        problems.append(f"{key}.{name} is not a field of megatron-core's {kind}{where}{hint}")
    return problems
