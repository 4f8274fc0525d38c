"""Models: one package per architecture (``verl/models/<arch>/``), each registering its :class:`ModelSpec`.

Importing :mod:`verl.models` registers every package listed in :data:`MODEL_PACKAGES` (their ``spec`` modules
import neither transformers' modeling files nor megatron). Adding an architecture is its folder plus one entry
here; see docs/advance/fsdp_extension.md.
"""

import importlib

# Each package's ``spec`` module registers its architectures (verl.models.spec) when imported.
MODEL_PACKAGES = ("verl.models.qwen3_5", "verl.models.qwen3")

for _package in MODEL_PACKAGES:
    importlib.import_module(f"{_package}.spec")
