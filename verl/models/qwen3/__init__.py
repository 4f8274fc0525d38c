"""Qwen3 dense (transformers' ``Qwen3ForCausalLM``): the second architecture, and the worked example of
docs/advance/fsdp_extension.md.

``spec`` registers it; ``hf_forward`` is its FSDP packed forward (varlen attention: several sequences in one
``(1, T)`` row never attend across their boundaries), installed by ``hf_patch``. It has no hf-engine decode
runner: the hf rollout generates with ``module.generate`` and says so once. Everything else (FLOPs formula,
vLLM weight names, LoRA's all-linear rule) is the shared dense-decoder behaviour.
"""
