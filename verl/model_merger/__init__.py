"""Turn an actor checkpoint (``global_step_N/actor``) into a plain Hugging Face model directory.

``python -m verl.model_merger merge --backend fsdp --local_dir .../global_step_N/actor --target_dir OUT``
gathers the FSDP2 shards and, for a LoRA run, folds the adapter (``actor/lora_adapter``) into the base
weights, so ``OUT`` loads with ``AutoModelForCausalLM.from_pretrained`` and serves without PEFT.
"""

from .fsdp_merger import load_actor_state, merge_fsdp_checkpoint

__all__ = ["load_actor_state", "merge_fsdp_checkpoint"]
