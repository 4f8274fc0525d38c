"""Pipelined generation on a rollout worker: several chunks in flight in one decode session.

A rollout pool of its own (the asynchronous modes) is driven by a controller thread that would otherwise call
``generate_sequences`` once per chunk and wait for the chunk's longest response. Here the worker keeps an
:class:`~verl.workers.rollout.hf_engine.session.EngineSession` open instead: ``submit`` hands a chunk to the
session and returns at once (the session's thread decodes it, sharing slots with the chunks already in flight);
``collect`` blocks until that chunk is done and lays it out as ``generate_sequences`` would. Ray runs one call
of an actor at a time, so the controller submits chunk k+1 before it collects chunk k.

The session opens at the first submit and closes when its last chunk is collected (it holds the module's
gathered weights and the slot cache). Weights change while it is open only through :meth:`ChunkPipeline.swap_weights`
(``async_training.partial_rollout``): the session pauses between decode steps, the caller's install copies the
new weights in place, and the live sequences go on with them (their prefixes re-prefilled). Every response token
is stamped with the weight version it was sampled with (``rollout_weight_version``); without partial rollout the
caller collects everything before installing weights, and :meth:`ChunkPipeline.pending` lets the worker refuse
otherwise.

Each chunk draws its sampling seed from the worker's global RNG at submit, as ``generate_sequences`` would at
its start: chunks consume the RNG in submission order, so the RNG state read right after a submit is the state
after that chunk (what a checkpoint keeps to resume exactly). This is the built-in engine's pipeline
(``rollout.name=hf`` on a model with a decode runner); an engine names its own in
``BaseRollout.chunk_pipeline_class`` (vLLM's: :mod:`verl.workers.rollout.vllm_rollout.pipeline`), and
:func:`supports_pipelining` says whether a rollout has one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Hashable, Optional

import torch

from verl.protocol import DataProto
from verl.workers.rollout.batching import outputs_to_batch, requests_from_batch, sampling_params_from_config


def supports_pipelining(rollout, agent_loop=None, rollout_group=None) -> bool:
    """An engine with a chunk pipeline (``chunk_pipeline_class``), without agent loops or a rollout group
    sharing one engine."""
    return getattr(rollout, "chunk_pipeline_class", None) is not None and agent_loop is None and rollout_group is None


class ChunkPipeline:
    def __init__(self, rollout, rollout_cfg, eos_ids: list[int], pad_token_id: int):
        self.rollout = rollout
        self.cfg = rollout_cfg
        self.eos_ids = list(eos_ids)
        self.pad_token_id = pad_token_id
        self._stack: Optional[contextlib.ExitStack] = None
        self._session = None
        self._params = None  # the session's sampling settings (baked into its engine)
        self._chunks: dict[Hashable, tuple] = {}

    def pending(self) -> int:
        return len(self._chunks)

    def submit(self, tag: Hashable, prompts: DataProto, depth: int, version: int = 0) -> None:
        """Start chunk ``tag``; ``version``: the weight version held now (the session's, once it is open)."""
        from verl.workers.rollout.hf_engine.entry import build_sequences, draw_seed

        if tag in self._chunks:
            raise ValueError(f"chunk {tag!r} is already in flight")
        if self._session is not None and self._session.version != version:
            raise RuntimeError(f"weight version {version} while the session decodes version {self._session.version}: "
                               "weights change mid-session only through swap_weights")
        params = sampling_params_from_config(self.cfg, prompts.meta_info, self.eos_ids)
        params = dataclasses.replace(params, seed=draw_seed(params))
        requests = requests_from_batch(prompts)
        module_config = self.rollout.module.config
        seqs, owner = build_sequences(requests, params, module_config, params.seed)
        if self._session is None:
            self._open(params, seqs, depth, version)
        elif dataclasses.replace(params, seed=None) != self._params:
            raise ValueError("a chunk with other sampling settings than the chunks in flight: collect those first")
        self._session.submit(tag, seqs)
        self._chunks[tag] = (prompts, params, owner, len(requests))

    def ready(self, tag: Hashable, timeout: float = 0.0) -> bool:
        """Whether chunk ``tag`` is done (waiting up to ``timeout`` seconds): its collect will not block."""
        if tag not in self._chunks:
            raise KeyError(f"chunk {tag!r} is not in flight")
        return self._session.ready(tag, timeout)

    def swap_weights(self, install: Callable[[], None], version: int) -> None:
        """Run ``install`` (new weights copied in place) with the session paused between decode steps, then go on
        as weight version ``version``. Without an open session, ``install`` just runs."""
        if self._session is None:
            install()
            return
        self._session.pause()
        try:
            install()
        finally:
            self._session.resume(version)

    def collect(self, tag: Hashable) -> DataProto:
        from verl.workers.rollout.hf_engine.entry import engine_outputs

        if tag not in self._chunks:
            raise KeyError(f"chunk {tag!r} is not in flight")
        prompts, params, owner, n_requests = self._chunks.pop(tag)
        try:
            results, stats = self._session.collect(tag)
        except BaseException:
            self._chunks.clear()
            self._close()
            raise
        self.rollout.last_stats = stats
        if not self._chunks:
            self._close()
        outputs = engine_outputs(results, owner, n_requests, params)
        out = outputs_to_batch(prompts, outputs, params.max_tokens, self.pad_token_id, with_logprobs=params.logprobs)
        first = {}
        for res, row in zip(results, owner):  # a row's response is its first sample (one per request here)
            first.setdefault(row, res.versions)
        out.batch["rollout_weight_version"] = token_versions([first[r] for r in range(n_requests)],
                                                             out.batch["response_mask"])
        return out

    def _open(self, params, seqs, depth: int, version: int) -> None:
        from verl.workers.rollout.hf_engine.entry import engine_options, open_engine
        from verl.workers.rollout.hf_engine.session import EngineSession

        opt, _ = engine_options(self.rollout.config)
        # Slots for `depth` chunks like this one (the user's max_num_seqs caps them); the cache holds the
        # configured prompt length so that later chunks' prompts fit without a rebuild.
        capacity = max(1, min(opt.max_num_seqs, depth * len(seqs)))
        max_new = max(s.max_new for s in seqs)
        prompt = max([int(self.cfg.get("prompt_length") or 0)] + [len(s.prompt.ids) for s in seqs])
        stack = contextlib.ExitStack()
        try:
            engine = stack.enter_context(open_engine(self.rollout, params))
            self._session = EngineSession(engine, capacity, prompt + max_new, max_new, version=version)
        except BaseException:
            stack.close()
            raise
        self._stack, self._params = stack, dataclasses.replace(params, seed=None)

    def _close(self) -> None:
        session, stack = self._session, self._stack
        self._session = self._stack = self._params = None
        try:
            if session is not None:
                session.close()
        finally:
            if stack is not None:
                stack.close()


def token_versions(spans: list, mask: torch.Tensor) -> torch.Tensor:
    """Per response token, the weight version it was sampled with (0 on padding): row ``r``'s tokens from
    ``start`` on carry ``version`` for each ``(start, version)`` of ``spans[r]``."""
    out = torch.zeros(mask.shape, dtype=torch.long)
    for r, row in enumerate(spans):
        for start, version in row or []:
            out[r, start:] = version
    return out * mask.long()
