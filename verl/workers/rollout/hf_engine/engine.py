"""Continuous-batching decode loop over preallocated slots, with the decode step captured as CUDA graphs.

Slots ``[0, n_active)`` hold the running sequences (kept contiguous: when sequences finish, the highest
running slots move down into the holes), so a step over ``b`` running sequences is the captured graph of the
smallest bucket ``>= b``. Finished slots are refilled from the waiting queue as soon as enough of them are
free (a prefill over many prompts costs about as much as one over a few), so a long tail does not idle the
batch. The host looks at the device every ``sync_every`` steps; a sequence that finished in between only
repeats no-op steps (its bookkeeping is masked on the device).

With ``num_speculative_tokens`` > 0 (``mtp.enable_rollout``) each step is a speculative one instead
(:mod:`.speculative`: draft with the runner's MTP head, verify in one forward, 1 .. k + 1 tokens per slot), run
eagerly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch

from verl.workers.rollout.hf_engine.cache import SlotCache, SpecShape
from verl.workers.rollout.hf_engine.runner import DecodeRunner, PrefillSeq
from verl.workers.rollout.hf_engine.sampling import SamplerConfig, sample_tokens

logger = logging.getLogger(__name__)


@dataclass
class SeqRequest:
    """One sequence to generate: its prompt, random-stream key and token budget."""

    prompt: PrefillSeq
    key: int
    max_new: int
    share_key: Optional[Hashable] = None  # equal keys (same prompt) share one prefill when admitted together


@dataclass
class SeqResult:
    tokens: list[int]
    log_probs: list[float]
    finish_reason: str
    # (prompt + response tokens, moe_layers, top_k) experts the forwards routed each token to (router replay);
    # the last response token was never fed to the model, so its row is -1
    routes: Optional[torch.Tensor] = None
    # speculative decoding: (draft tokens proposed, accepted, verification steps) of this sequence
    spec: Optional[tuple[int, int, int]] = None
    # [(first token, weight version)]: the weights each stretch of tokens was sampled with (a session sets it;
    # one entry unless the weights changed while the sequence ran, see EngineSession.resume)
    versions: Optional[list[tuple[int, int]]] = None


@dataclass
class EngineOptions:
    max_num_seqs: int = 256
    prefill_tokens: int = 8192  # prompt tokens per packed prefill forward
    use_cuda_graph: bool = True
    capture_sizes: Optional[list[int]] = None
    sync_every: int = 4
    continuous: bool = True
    admit_fraction: float = 0.125  # refill once this fraction of the slots (or all that wait) is free
    state_dtype: torch.dtype = torch.float32
    gpu_memory_utilization: Optional[float] = None  # cap on (memory in use + slot cache) / device memory
    record_routes: bool = False  # keep every token's MoE routes (runner.route_shape) in the slot cache
    num_speculative_tokens: int = 0  # > 0: speculative decoding, drafting this many tokens a step (.speculative)
    stats: dict = field(default_factory=dict)


def default_capture_sizes(capacity: int) -> list[int]:
    """1, 2, 4, ..., 32, then every 32 up to the slot count (a step runs at most 32 idle rows)."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < capacity] + list(range(64, capacity, 32)) + [capacity]
    return sorted(set(sizes))


class DecodeEngine:
    def __init__(self, runner: DecodeRunner, sampler: SamplerConfig, stop_ids: list[int], options: EngineOptions):
        self.runner, self.sampler, self.opt = runner, sampler, options
        dev = runner.device
        self.stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
        self.stop_set = set(int(s) for s in stop_ids)
        sup = sampler.suppress_ids
        self.suppress = torch.tensor(list(sup), dtype=torch.long, device=dev) if sup else None
        self.cache: Optional[SlotCache] = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._buckets: list[int] = []  # batch-size buckets of the captured decode step (empty: eager)
        self._pool = None

    # ------------------------------------------------------------------------------------------ device steps
    def _book(self, rows: torch.Tensor, logits: torch.Tensor, fed_token: bool) -> None:
        """Sample for ``rows`` and record token, log-prob and finish state (no host sync). ``fed_token``: the
        step consumed the previous token (decode), so it now sits in the cache."""
        c = self.cache
        steps = c.steps[rows]
        active = ~c.done[rows]
        tok, lp = sample_tokens(logits, self.sampler, c.keys[rows], steps, self.suppress)
        col = steps.clamp(max=c.max_new - 1)
        c.out_tokens[rows, col] = torch.where(active, tok, c.out_tokens[rows, col])
        c.out_logprobs[rows, col] = torch.where(active, lp, c.out_logprobs[rows, col])
        inc = active.long()
        new_steps = steps + inc
        c.steps[rows] = new_steps
        if fed_token:
            c.lengths[rows] = c.lengths[rows] + inc
        c.tokens[rows] = torch.where(active, tok, c.tokens[rows])
        finished = new_steps >= c.limit[rows]
        if self.stop.numel():
            finished = finished | torch.isin(tok, self.stop)
        c.done[rows] = c.done[rows] | (active & finished)

    def _decode_eager(self, b: int) -> None:
        rows = torch.arange(b, device=self.runner.device)
        self._book(rows, self.runner.decode_logits(self.cache, b), fed_token=True)

    def _warm_up(self, sizes: list[int]) -> None:
        """Eager steps for the largest and the smallest bucket before any sequence is live (they write only into
        still-empty slots): kernel compiles and library handles happen here, so that a bucket's graph can be
        captured later, mid-run, without executing anything."""
        self._pool = torch.cuda.graph_pool_handle()
        self._buckets = sorted(sizes)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in {max(sizes), min(sizes)}:
                self._decode_eager(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The bucket's captured step, captured on first use: a run whose batch stays full captures one graph,
        not one per bucket. Capturing records kernels without running them, so live slots are untouched."""
        graph = self.graphs.get(bucket)
        if graph is None:
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._decode_eager(bucket)
            self.graphs[bucket] = graph
            self.opt.stats["capture_s"] = self.opt.stats.get("capture_s", 0.0) + time.perf_counter() - t0
            self.opt.stats["graphs"] = len(self.graphs)
        return graph

    def _decode(self, b: int) -> None:
        # Named ranges (here and around the prefill) let a profile of a rollout split its kernels by phase
        # (scripts/trace_top_kernels.py --window); outside a profiler a range costs about a microsecond.
        with torch.profiler.record_function("hf_engine::decode"):
            self._decode_step(b)

    def _decode_step(self, b: int) -> None:
        if self.cache.spec is not None:
            from verl.workers.rollout.hf_engine.speculative import speculative_step

            speculative_step(self, b)
        elif self._buckets:
            self._graph(min(s for s in self._buckets if s >= b)).replay()
        else:
            self._decode_eager(b)

    # ------------------------------------------------------------------------------------------ host loop
    @torch.no_grad()
    def run(self, seqs: list[SeqRequest]) -> list[SeqResult]:
        if not seqs:
            return []
        capacity = max(1, min(self.opt.max_num_seqs, len(seqs)))
        max_new = max(s.max_new for s in seqs)
        capacity = self.setup(capacity, max(len(s.prompt.ids) for s in seqs) + max_new, max_new)
        try:
            results = self._loop(seqs, capacity)
            self.opt.stats.update(self.spec_stats(results))
            self.opt.stats["run_s"] = time.perf_counter() - self._t_setup
            return results
        finally:
            self.teardown()

    def setup(self, capacity: int, max_len: int, max_new: int) -> int:
        """Allocate the slot cache (``capacity`` slots, fewer if memory says so) and warm up the captured decode
        step; clears the stats. Returns the slot count. :meth:`run` and a
        :class:`~verl.workers.rollout.hf_engine.session.EngineSession` (which keeps one cache across chunks) both
        start here."""
        opt, runner = self.opt, self.runner
        spec = self._spec_shape()
        capacity = self._fit_memory(capacity, max_len, spec)
        routes = getattr(runner, "route_shape", None) if opt.record_routes else None
        if opt.record_routes and routes is None:
            raise ValueError("rollout.enable_rollout_routing_replay=true needs a MoE model whose runner records "
                             "routes (this model has no top-k router)")
        self.cache = SlotCache(runner.shape, capacity, max_len, max_new, runner.device, runner.dtype,
                               opt.state_dtype, routes=routes, spec=spec)
        try:
            graphs = opt.use_cuda_graph and runner.device.type == "cuda"
            if graphs and spec is not None:
                logger.warning("hf rollout: speculative decoding (mtp.enable_rollout) runs its draft / verify steps "
                               "eagerly; the decode step is not captured as CUDA graphs")
                graphs = False
            if graphs and runner.syncs_host:
                logger.warning("hf rollout: the MoE block syncs with the host (transformers' eager expert loop, or "
                               "a LoRA-wrapped expert), so decode steps run eagerly without CUDA graphs")
                graphs = False
            self._t_setup = time.perf_counter()
            self.opt.stats.clear()
            self.opt.stats.update(capture_s=0.0, prefill_s=0.0, prefills=0, prefill_tokens=0, decode_steps=0,
                                  slot_steps=0, device_wait_s=0.0, cuda_graphs=int(graphs), slots=capacity)
            if graphs:
                t0 = time.perf_counter()
                sizes = sorted({min(s, capacity) for s in (opt.capture_sizes or default_capture_sizes(capacity))})
                if capacity not in sizes:
                    sizes.append(capacity)
                self._warm_up(sizes)
                self.opt.stats["warmup_s"] = time.perf_counter() - t0
        except BaseException:
            self.teardown()
            raise
        return capacity

    def teardown(self) -> None:
        """Drop the graphs and the slot cache."""
        self.graphs.clear()
        self._buckets, self._pool = [], None
        self.cache = None

    def spec_stats(self, results: list[SeqResult]) -> dict:
        """Speculative decoding's acceptance over ``results`` (empty for plain decoding)."""
        if self.cache is None or self.cache.spec is None:
            return {}
        from verl.workers.rollout.hf_engine.speculative import spec_stats

        return spec_stats([r.spec for r in results])

    def _spec_shape(self) -> Optional[SpecShape]:
        """The speculative cache layout (None: plain decoding); refuses what speculative decoding lacks."""
        k = int(self.opt.num_speculative_tokens or 0)
        if k <= 0:
            return None
        if not hasattr(self.runner, "spec_shape"):
            raise ValueError("actor_rollout_ref.model.mtp.enable_rollout=true: this model's decode runner has no "
                             "speculative decoding (Qwen3.5 with an MTP head only)")
        if self.opt.record_routes:
            raise ValueError("actor_rollout_ref.model.mtp.enable_rollout=true together with "
                             "rollout.enable_rollout_routing_replay=true is not implemented (the verification "
                             "forward does not record routes); set one of them to false")
        return self.runner.spec_shape(k)

    def _fit_memory(self, capacity: int, max_len: int, spec: Optional[SpecShape] = None) -> int:
        """Fewer slots when their cache would push the device past ``gpu_memory_utilization``."""
        util, dev = self.opt.gpu_memory_utilization, self.runner.device
        if not util or dev.type != "cuda":
            return capacity
        total = torch.cuda.get_device_properties(dev).total_memory
        room = total * util - torch.cuda.memory_allocated(dev)
        shape, dtype, state_dtype = self.runner.shape, self.runner.dtype, self.opt.state_dtype
        per_slot = shape.bytes_per_slot(max_len, dtype, state_dtype)
        if spec is not None:
            per_slot += spec.bytes_per_slot(shape, max_len, dtype, state_dtype)
        # a quarter of the room stays free for activations, logits and the graphs' memory pool
        fit = max(1, int(0.75 * room // per_slot))
        if fit < capacity:
            logger.warning(f"hf rollout: {capacity} slots of {per_slot / 2**20:.0f} MiB would exceed "
                           f"gpu_memory_utilization={util}; using {fit}")
            return fit
        return capacity

    def _loop(self, seqs: list[SeqRequest], capacity: int) -> list[SeqResult]:
        results: list[Optional[SeqResult]] = [None] * len(seqs)
        waiting = deque(range(len(seqs)))
        running: list[int] = []  # running[slot] = index into seqs
        budget: dict[int, int] = {}
        while waiting or running:
            self.step(seqs, waiting, running, budget, results, capacity)
        return results  # type: ignore[return-value]

    def step(self, seqs: list[SeqRequest], waiting: deque, running: list[int], budget: dict[int, int],
             results: list, capacity: int) -> None:
        """One round of the host loop: admit waiting sequences into free slots, run up to ``sync_every`` decode
        steps, retire what finished into ``results`` (indexed like ``seqs``). ``seqs`` and ``results`` may grow
        between rounds (a session appends new chunks' sequences; indices stay valid)."""
        free = capacity - len(running)
        admit_min = max(1, int(capacity * self.opt.admit_fraction))
        if waiting and free and (not running or (self.opt.continuous and free >= min(len(waiting), admit_min))):
            self._admit(seqs, waiting, running, capacity)
        if not running:
            return
        stats = self.opt.stats
        b = len(running)
        # Tokens each running sequence may still produce (prefill drew its first). Every decode step draws one
        # for every live slot, so the host knows this without reading the device, and never runs steps that
        # no sequence can use (short responses: 6 tokens took 8 steps with sync_every=4).
        for i in running:
            budget.setdefault(i, seqs[i].max_new - 1)
        n = min(self.opt.sync_every, max(budget[i] for i in running))
        for _ in range(n):
            self._decode(b)
        for i in running:
            budget[i] -= n
        stats["decode_steps"] += n
        stats["slot_steps"] += n * b
        # The host's one look per round waits here for the queued steps: the wait's share of the decode time
        # tells a GPU-bound loop (the host sits here most of the time) from a host-bound one (the GPU idles).
        t0 = time.perf_counter()
        done = self.cache.done[:b].tolist()
        stats["device_wait_s"] += time.perf_counter() - t0
        if any(done):
            self._retire(seqs, running, done, results)

    def _admit(self, seqs, waiting: deque, running: list[int], capacity: int) -> None:
        """Move waiting sequences into the free slots, prefilling at most ``prefill_tokens`` prompt tokens per
        forward; sequences with the same ``share_key`` in one forward share its prefill."""
        batch: list[int] = []
        seen: set = set()
        tokens = 0
        while waiting and len(running) + len(batch) < capacity:
            i = waiting[0]
            key = self._share_key(seqs, i)
            cost = 0 if key in seen else len(seqs[i].prompt.ids)
            if batch and tokens + cost > self.opt.prefill_tokens:
                self._prefill(seqs, batch, running)
                batch, seen, tokens = [], set(), 0
                continue
            waiting.popleft()
            batch.append(i)
            seen.add(key)
            tokens += cost
        if batch:
            self._prefill(seqs, batch, running)

    @staticmethod
    def _share_key(seqs, i: int) -> Hashable:
        return seqs[i].share_key if seqs[i].share_key is not None else ("seq", i)

    def _prefill(self, seqs, batch: list[int], running: list[int]) -> None:
        with torch.profiler.record_function("hf_engine::prefill"):
            self._prefill_batch(seqs, batch, running)

    def _prefill_batch(self, seqs, batch: list[int], running: list[int]) -> None:
        c, dev = self.cache, self.runner.device
        slots = list(range(len(running), len(running) + len(batch)))
        unique: dict[Hashable, int] = {}
        prompts, targets, order = [], [], []
        for slot, i in zip(slots, batch):
            key = self._share_key(seqs, i)
            if key not in unique:
                unique[key] = len(prompts)
                prompts.append(seqs[i].prompt)
                targets.append([])
            targets[unique[key]].append(slot)
            order.append(unique[key])
        rows = torch.tensor(slots, device=dev)
        c.keys[rows] = torch.tensor([seqs[i].key for i in batch], device=dev)
        c.limit[rows] = torch.tensor([seqs[i].max_new for i in batch], device=dev)
        c.steps[rows] = 0
        c.done[rows] = False
        if c.spec is not None:
            c.spec.seq_stats[rows] = 0
        t0 = time.perf_counter()
        logits = self.runner.prefill(c, prompts, targets)
        self._book(rows, logits.index_select(0, torch.tensor(order, device=dev)), fed_token=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # for the timing below; admission is a sync point anyway
        running.extend(batch)
        st = self.opt.stats
        st["prefill_s"] += time.perf_counter() - t0
        st["prefills"] += 1
        st["prefill_tokens"] += sum(len(p.ids) for p in prompts)

    def reprefill(self, seqs, running: list[int]) -> list[int]:
        """After the weights changed in place mid-generation: run each live sequence's prompt and the tokens it has
        fed so far through the new weights again, into its own slot (attention keys/values, Gated DeltaNet conv
        and recurrent states), so every later token is sampled from the new policy given the whole prefix
        (upstream's abort + resubmit does the same: vLLM re-prefills the prefix). Keeping the old prefix state
        instead would cost nothing, but the tokens after the update would come from neither policy, and their
        recorded log-probs would match no recompute. The last sampled token (the next step's input) is kept, not
        drawn again: the prefill's logits are dropped. Returns the tokens each slot had sampled (the old
        weights' share)."""
        c = self.cache
        if c.spec is not None or c.routes is not None:
            raise NotImplementedError("continuing sequences across a weight update (async_training.partial_rollout) "
                                      "with speculative decoding or recorded MoE routes is not implemented")
        b = len(running)
        if not b:
            return []
        t0 = time.perf_counter()
        steps, toks = c.steps[:b].tolist(), c.out_tokens[:b].tolist()
        group: list[PrefillSeq] = []
        slots: list[list[int]] = []
        total = 0
        for slot, i in enumerate(running):
            prompt = seqs[i].prompt
            fed = PrefillSeq(list(prompt.ids) + toks[slot][: steps[slot] - 1], prompt.mm)  # = cache.lengths[slot]
            if group and sum(len(g.ids) for g in group) + len(fed.ids) > self.opt.prefill_tokens:
                self.runner.prefill(c, group, slots)
                group, slots = [], []
            group.append(fed)
            slots.append([slot])
            total += len(fed.ids)
        self.runner.prefill(c, group, slots)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        st = self.opt.stats
        st["reprefills"] = st.get("reprefills", 0) + b
        st["reprefill_tokens"] = st.get("reprefill_tokens", 0) + total
        st["reprefill_s"] = st.get("reprefill_s", 0.0) + time.perf_counter() - t0
        return steps

    def _retire(self, seqs, running: list[int], done: list[bool], results: list) -> None:
        c = self.cache
        fin = [slot for slot, d in enumerate(done) if d]
        idx = torch.tensor(fin, device=c.tokens.device)
        n = c.steps[idx].tolist()
        toks = c.out_tokens[idx].tolist()
        lps = c.out_logprobs[idx].tolist()
        routes = c.routes[idx].cpu() if c.routes is not None else None  # one copy per retirement, not per step
        spec = c.spec.seq_stats[idx].tolist() if c.spec is not None else None
        for j, slot in enumerate(fin):
            k = n[j]
            out = toks[j][:k]
            reason = "stop" if out and out[-1] in self.stop_set else "length"
            seq_routes = None
            if routes is not None:
                total = len(seqs[running[slot]].prompt.ids) + k
                seq_routes = routes[j, :total].clone()
                seq_routes[total - 1] = -1  # the last sampled token was never an input (see SeqResult)
            results[running[slot]] = SeqResult(out, lps[j][:k], reason, seq_routes,
                                               tuple(spec[j]) if spec is not None else None)
        keep = [slot for slot, d in enumerate(done) if not d]
        moves = [(src, dst) for dst, src in enumerate(keep) if src != dst]
        if moves:
            c.move([s for s, _ in moves], [d for _, d in moves])
        running[:] = [running[slot] for slot in keep]
        c.release(list(range(len(keep), len(done))))
