"""vLLM rollout: colocated engine (:mod:`.vllm_rollout`) and server mode (:mod:`.server`).

Importing this package does not import vLLM; the engine modules do so lazily.
"""


def create_vllm_rollout(config, model_config, tokenizer=None, module=None, processor=None):
    """The engine for ``rollout.name=vllm``: a separate server process when ``rollout.mode=server``,
    otherwise the colocated in-process engine (upstream's ``async`` / ``sync`` modes both colocate here)."""
    mode = str(config.get("mode", "sync")) if hasattr(config, "get") else "sync"
    if mode == "server":
        from .server import vLLMServerClient

        return vLLMServerClient(config, model_config, tokenizer, module, processor)
    from .vllm_rollout import vLLMRollout

    return vLLMRollout(config, model_config, tokenizer, module, processor)
