"""Qwen3.5 (dense, MoE, VL): the pieces of this architecture that the shared code reaches through its model spec."""
