"""Qwen3.5 on megatron-core without Transformer Engine (the "local spec").

Layers are assembled from megatron-core's tensor-parallel building blocks (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, TransformerLayer/TransformerBlock, MoELayer with SequentialMLP
experts) plus this project's Gated DeltaNet kernels (fla's varlen conv and chunked gated delta rule on CUDA, the
pure-torch reference elsewhere). Importing this package needs megatron-core (the ``mcore`` extra).
"""

from verl.models.mcore import require_megatron

require_megatron()
