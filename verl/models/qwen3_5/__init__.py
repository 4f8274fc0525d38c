"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention; dense, MoE, VL): everything the framework knows.

``spec`` names each piece (and registers the architectures); ``hf_patch`` / ``hf_forward`` / ``gated_deltanet``
/ ``hf_attention`` are the FSDP packed forwards, ``npu_patch`` the Ascend fused forwards, ``mcore`` the
megatron-core model, its config mapping and HF<->mcore weight converter, ``weight_sync`` the rollout-engine name
layout, ``hf_runner`` / ``decode_kernels`` the hf engine's decode runner, ``flops`` the FLOPs formula,
``vllm_arch`` / ``vllm_text_models`` what vLLM needs registered for the text-only checkpoints, and ``tiny`` the
random test checkpoints.
"""
