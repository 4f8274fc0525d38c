"""vLLM rollout: colocated engine (:mod:`.vllm_rollout`) and server mode (:mod:`.server`).

Importing this package does not import vLLM; the engine modules do so lazily.
"""


def create_vllm_rollout(config, model_config, tokenizer=None, module=None, processor=None):
    """The engine for ``rollout.name=vllm``.

    ``rollout.checkpoint_engine.backend`` (upstream's key for how weights reach the rollout) picks the mode:
    ``naive`` (default) builds the engine inside this trainer process; ``nccl`` (CUDA), ``hccl`` (Ascend) or
    ``gloo`` (CPU hosts) starts it as a separate server process that receives weights over that collective.
    """
    from verl.utils.device import get_device_name

    from .engine_args import server_backend

    backend = server_backend(config, get_device_name())
    if backend is not None:
        from .server import vLLMServerClient

        return vLLMServerClient(config, model_config, tokenizer, module, processor, backend=backend)
    from .vllm_rollout import vLLMRollout

    return vLLMRollout(config, model_config, tokenizer, module, processor)
