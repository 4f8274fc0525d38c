"""Qwen3.5 on megatron-core without Transformer Engine (the "local spec").

Layers are assembled from megatron-core's tensor-parallel building blocks (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, TransformerLayer/TransformerBlock, MoELayer with SequentialMLP
experts) plus this project's Gated DeltaNet kernels (fla's varlen conv and chunked gated delta rule on CUDA, the
pure-torch reference elsewhere). ``config`` and ``weight_converter`` are pure torch; the model modules
(``model``, ``spec``, ``attention``, ``gated_deltanet``, ``forward``, ``common``) import megatron-core (the
``mcore`` extra), which :func:`verl.models.mcore.registry.init_mcore_model` checks before building.
"""
