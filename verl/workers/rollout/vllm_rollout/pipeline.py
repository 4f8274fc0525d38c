"""vLLM's chunk pipeline: several chunks in flight in one engine, weights installed while they decode.

The asynchronous modes' rollout pool (:mod:`verl.experimental.async_policy.pool`) hands a worker chunk after
chunk; :class:`verl.workers.rollout.pipelined.ChunkPipeline` is the built-in engine's way of keeping them in
flight, this is vLLM's. ``vllm.LLM.generate`` runs one batch to its end, so the pipeline drives the engine
underneath it instead (``LLM.llm_engine``: ``add_request``, ``step``, ``abort_request``): a thread steps the
engine while requests are live, ``submit`` adds a chunk's requests between two steps, so the chunks share vLLM's
continuous batching, and ``collect`` waits for a chunk's last request.

Weights change only through :meth:`VLLMChunkPipeline.swap_weights` (``async_training.partial_rollout``): between
two steps every unfinished request is aborted, keeping the tokens (and log-probs) it has; the caller's install
reloads the weights (which drops vLLM's prefix cache, computed with the old ones); each unfinished response is
then submitted again as prompt + its tokens so far, for the tokens it has left, and re-prefilled with the new
weights, as upstream's partial rollout resumes an interrupted request. Each response token is stamped with the
weight version it was sampled with (``rollout_weight_version``).

Requests stream their tokens as deltas (``RequestOutputKind.DELTA``): a response of thousands of tokens is not
copied again at every step. The engine samples with its own generator (``rollout.seed``), as
``vLLMRollout.generate`` does: the workers' global RNG plays no part, so a resumed run does not re-draw the same
samples (the built-in engine's pipeline does).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from verl.protocol import DataProto
from verl.workers.rollout.base import GenerationOutput
from verl.workers.rollout.batching import outputs_to_batch, requests_from_batch, sampling_params_from_config
from verl.workers.rollout.pipelined import token_versions

from .engine_args import vllm_sampling_kwargs


@dataclass
class _Response:
    """One row of a chunk: its prompt, what it has generated so far (over every resubmission) and where each
    weight version's tokens start."""

    prompt: dict  # vLLM's prompt dict: prompt_token_ids (+ multi_modal_data)
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token, weight version)
    finish_reason: Optional[str] = None
    request_id: Optional[str] = None  # the live vLLM request, None once finished
    segments: int = 0


@dataclass
class _Chunk:
    prompts: DataProto
    params: object  # our SamplingParams
    vllm_params: object  # vllm.SamplingParams (DELTA outputs)
    rows: list[_Response]
    left: int  # rows not finished yet


class VLLMChunkPipeline:
    """``rollout``: a colocated :class:`~verl.workers.rollout.vllm_rollout.vllm_rollout.vLLMRollout` whose engine
    is this rank's alone (``spmd_ranks == 1``)."""

    def __init__(self, rollout, rollout_cfg, eos_ids: list[int], pad_token_id: int):
        self.rollout = rollout
        self.cfg = rollout_cfg
        self.eos_ids = list(eos_ids)
        self.pad_token_id = pad_token_id
        self._engine = rollout.llm.llm_engine
        self._cond = threading.Condition()
        # Callers waiting for the lock: the stepping thread lets them in before its next step. (A thread that
        # releases a lock and takes it again at once keeps it: the worker's calls would wait out whole responses.)
        self._callers = 0
        self._callers_lock = threading.Lock()
        self._chunks: dict[Hashable, _Chunk] = {}
        self._live: dict[str, tuple[Hashable, int]] = {}  # vLLM request id -> (chunk, row)
        self._error: Optional[BaseException] = None
        self._thread_id = 0  # the stepping thread that may run (a halted one exits at its next wake-up)
        self._running = False
        self._version = 0
        self._stats = _zero_stats()

    # -------------------------------------------------------------- the worker's side
    def pending(self) -> int:
        return len(self._chunks)

    def submit(self, tag: Hashable, prompts: DataProto, depth: int, version: int = 0) -> None:
        """Start chunk ``tag`` with the weights of version ``version`` (``depth`` is the built-in engine's slot
        sizing; vLLM schedules up to its ``max_num_seqs`` itself)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if tag in self._chunks:
            raise ValueError(f"chunk {tag!r} is already in flight")
        if self._chunks and version != self._version:
            raise RuntimeError(f"weight version {version} while the engine decodes version {self._version}: "
                               "weights change mid-flight only through swap_weights")
        params = sampling_params_from_config(self.cfg, prompts.meta_info, self.eos_ids)
        vp = SamplingParams(**vllm_sampling_kwargs(params))
        vp.output_kind = RequestOutputKind.DELTA
        rows = []
        for req in requests_from_batch(prompts):
            prompt = {"prompt_token_ids": list(req.prompt_token_ids)}
            if req.multi_modal_data:
                prompt["multi_modal_data"] = req.multi_modal_data
            rows.append(_Response(prompt, int(params.max_tokens)))
        with self._turn():
            self._raise_error()
            self._version = int(version)
            self._chunks[tag] = _Chunk(prompts, params, vp, rows, len(rows))
            for i in range(len(rows)):
                self._add(tag, i)
            self._start()
            self._cond.notify_all()

    def ready(self, tag: Hashable, timeout: float = 0.0) -> bool:
        """Whether chunk ``tag`` is done (waiting up to ``timeout`` seconds): its collect will not block."""
        with self._turn():
            if tag not in self._chunks:
                raise KeyError(f"chunk {tag!r} is not in flight")
            self._cond.wait_for(lambda: self._chunks[tag].left == 0 or self._error is not None, timeout)
            self._raise_error()
            return self._chunks[tag].left == 0

    def swap_weights(self, install: Callable[[], None], version: int) -> None:
        """Between two engine steps: abort the unfinished requests (keeping their tokens), run ``install``, and
        submit each unfinished response again as prompt + its tokens, to go on as weight version ``version``."""
        with self._turn():  # (held throughout: the stepping thread cannot step until the swap is done)
            self._raise_error()
            live = list(self._live.values())
            if live:
                self._engine.abort_request(list(self._live))
                self._live.clear()
            install()
            self._version = int(version)
            for tag, i in live:
                row = self._chunks[tag].rows[i]
                self._stats["reprefills"] += 1
                self._stats["reprefill_tokens"] += len(row.prompt["prompt_token_ids"]) + len(row.tokens)
                self._add(tag, i)
            self._stats["pauses"] += 1

    def collect(self, tag: Hashable) -> DataProto:
        """Chunk ``tag`` (blocking until its last response ends), laid out as ``generate_sequences`` returns it."""
        with self._turn():
            if tag not in self._chunks:
                raise KeyError(f"chunk {tag!r} is not in flight")
            self._cond.wait_for(lambda: self._chunks[tag].left == 0 or self._error is not None)
            if self._error is not None:
                error, self._error = self._error, None
                self._chunks.clear()
                self._live.clear()
                self._halt()
                raise RuntimeError(f"the vLLM engine failed while chunks were in flight: {error}") from error
            chunk = self._chunks.pop(tag)
            stats, self._stats = self._stats, _zero_stats()
            if not self._chunks:
                self._halt()
        self.rollout.last_stats = stats
        outputs = [[GenerationOutput(r.tokens, r.log_probs if chunk.params.logprobs else None,
                                     r.finish_reason or "length")] for r in chunk.rows]
        out = outputs_to_batch(chunk.prompts, outputs, chunk.params.max_tokens, self.pad_token_id,
                               with_logprobs=chunk.params.logprobs)
        out.batch["rollout_weight_version"] = token_versions([r.spans for r in chunk.rows],
                                                             out.batch["response_mask"])
        return out

    @contextmanager
    def _turn(self):
        """The lock, taken between two engine steps ahead of the stepping thread."""
        with self._callers_lock:
            self._callers += 1
        try:
            self._cond.acquire()
        finally:
            with self._callers_lock:
                self._callers -= 1
        # The stepping thread may wait for the queue of callers to empty: it checks again as soon as this caller
        # waits on the condition (ready, collect) or leaves.
        self._cond.notify_all()
        try:
            yield
        finally:
            self._cond.notify_all()  # (the stepping thread waits while callers are queued)
            self._cond.release()

    # -------------------------------------------------------------- the engine's side (under the lock)
    def _add(self, tag: Hashable, i: int) -> None:
        """Submit row ``i`` of chunk ``tag`` for the tokens it has left (its prompt: the original + its tokens)."""
        chunk = self._chunks[tag]
        row = chunk.rows[i]
        left = row.max_tokens - len(row.tokens)
        if left <= 0:
            self._finish(chunk, row, "length")
            return
        prompt = dict(row.prompt, prompt_token_ids=row.prompt["prompt_token_ids"] + row.tokens)
        params = chunk.vllm_params
        if row.tokens:
            params = params.clone()
            params.max_tokens = left
        row.request_id = f"{tag}-{i}-{row.segments}"
        row.segments += 1
        row.spans.append((len(row.tokens), self._version))
        self._engine.add_request(row.request_id, prompt, params)
        self._live[row.request_id] = (tag, i)

    def _finish(self, chunk: _Chunk, row: _Response, reason: Optional[str]) -> None:
        row.finish_reason = "stop" if reason == "stop" else (reason or "length")
        row.request_id = None
        chunk.left -= 1

    def _absorb(self, outputs) -> None:
        for out in outputs:
            owner = self._live.get(out.request_id)
            if owner is None:  # (aborted at a swap)
                continue
            chunk = self._chunks[owner[0]]
            row = chunk.rows[owner[1]]
            sample = out.outputs[0]
            new = list(sample.token_ids)
            row.tokens.extend(new)
            if chunk.params.logprobs:
                if sample.logprobs is None or len(sample.logprobs) != len(new):
                    raise RuntimeError("vLLM returned no per-token log-probs although they were requested")
                row.log_probs.extend(float(step[t].logprob) for step, t in zip(sample.logprobs, new))
            if out.finished:
                del self._live[out.request_id]
                self._finish(chunk, row, sample.finish_reason)

    def _run(self, me: int) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._thread_id != me or (self._live and not self._callers))
                if self._thread_id != me:
                    return
                try:
                    self._absorb(self._engine.step())
                    self._stats["steps"] += 1
                except BaseException as exc:  # noqa: BLE001 - the collect that waits for it raises it
                    self._error = exc
                    self._cond.notify_all()
                    return
                self._cond.notify_all()

    def _start(self) -> None:
        if not self._running:
            self._running = True
            self._thread_id += 1
            threading.Thread(target=self._run, args=(self._thread_id,), name="vllm-chunk-pipeline",
                             daemon=True).start()

    def _halt(self) -> None:
        """Stop the stepping thread (no chunk is left: ``generate`` may use the engine again). Under the lock: the
        thread exits at its next wake-up without stepping; a later submit starts a new one."""
        self._running = False
        self._thread_id += 1
        self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine failed while chunks were in flight: {self._error}") from self._error


def _zero_stats() -> dict:
    return {"steps": 0, "pauses": 0, "reprefills": 0, "reprefill_tokens": 0}
