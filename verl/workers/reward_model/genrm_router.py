"""The reward router: an OpenAI-compatible ``/v1/chat/completions`` endpoint in front of the judge model.

Upstream serves a generative reward model with vLLM / SGLang behind a router and hands custom reward functions
its address (``reward_router_address``). Here the judge runs in the project's built-in rollout engine on the
reward-model workers; this router lives in the controller process, renders each request's ``messages`` with the
judge's chat template, and batches the requests that arrive together (a reward manager scores a batch's rows
concurrently) into one generation call on the workers. Only the chat-completions subset a judge needs is
served; a request field it cannot honour is answered with a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from verl.workers.rollout.base import SamplingParams

__all__ = ["GenRMRouter", "JudgeDefaults", "RequestError"]

# Fields accepted with any value, because they do not change what is generated here (``model``: one judge is
# served; ``stream`` false is the only mode; ``user``/``logprobs`` false: nothing to return).
_IGNORED = {"model", "user"}
_SUPPORTED = {"messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "seed",
              "stream", "logprobs"}


class _Server(ThreadingHTTPServer):
    # A reward manager opens up to 64 connections at once; the socket module's default backlog of 5 would reset
    # the ones beyond it.
    request_queue_size = 1024
    daemon_threads = True


class RequestError(ValueError):
    """A request the router refuses (answered with HTTP 400 and this message)."""


@dataclass(frozen=True)
class JudgeDefaults:
    """``reward.reward_model.rollout`` values a request falls back to."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    prompt_length: int = 2048
    response_length: int = 2048

    @classmethod
    def from_config(cls, rollout) -> "JudgeDefaults":
        get = (rollout or {}).get
        return cls(float(get("temperature", 1.0)), float(get("top_p", 1.0)), int(get("top_k", -1)),
                   bool(get("do_sample", True)), int(get("prompt_length", 2048)), int(get("response_length", 2048)))


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    result: list | None = None  # [(text, finish_reason, n_tokens)] per choice
    error: BaseException | None = None


# generate(prompts, params) -> per prompt, per choice (token ids, finish_reason)
Backend = Callable[[list[list[int]], SamplingParams], list[list[tuple[list[int], str]]]]


class GenRMRouter:
    """Starts serving on ``127.0.0.1`` at construction (``address`` is known before the judge is loaded, so the
    reward managers can be built first); requests wait until :meth:`attach` gives it the judge's backend."""

    def __init__(self, tokenizer, defaults: JudgeDefaults, batch_window_s: float = 0.05):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the judge's tokenizer (reward.reward_model.model_path) has no chat template; the "
                             "router renders each request's messages with it")
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.batch_window_s = batch_window_s
        self._backend: Backend | None = None
        self._attached = threading.Event()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "generate_calls": 0, "completion_tokens": 0, "generate_s": 0.0}
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        threading.Thread(target=self._server.serve_forever, name="genrm-router", daemon=True).start()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="genrm-batcher", daemon=True)
        self._dispatcher.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def attach(self, backend: Backend) -> None:
        self._backend = backend
        self._attached.set()

    def close(self) -> None:
        self._queue.put(None)
        self._server.shutdown()
        self._server.server_close()

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the last call, as ``reward/genrm/*`` metrics (zero rows: an empty dict)."""
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(self._stats, 0)
        if not stats["requests"]:
            return {}
        return {"reward/genrm/requests": float(stats["requests"]),
                "reward/genrm/generate_calls": float(stats["generate_calls"]),
                "reward/genrm/completion_tokens_mean": stats["completion_tokens"] / stats["requests"],
                "timing_s/genrm_generate": float(stats["generate_s"])}

    # ------------------------------------------------------------------ one request
    def sampling_for(self, body: dict) -> SamplingParams:
        unknown = sorted(set(body) - _SUPPORTED - _IGNORED)
        if unknown:
            raise RequestError(f"unsupported chat-completions field(s) {unknown}; the GenRM router serves "
                               f"{sorted(_SUPPORTED | _IGNORED)}")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the GenRM router")
        if body.get("logprobs"):
            raise RequestError("logprobs=true is not supported by the GenRM router")
        d = self.defaults
        temperature = _number(body, "temperature", d.temperature if d.do_sample else 0.0)
        max_tokens = int(_number(body, "max_tokens", _number(body, "max_completion_tokens", d.response_length)))
        if not 1 <= max_tokens <= d.response_length:
            raise RequestError(f"max_tokens={max_tokens} is outside [1, reward.reward_model.rollout.response_length="
                               f"{d.response_length}]")
        n = int(_number(body, "n", 1))
        if n < 1:
            raise RequestError(f"n={n} must be at least 1")
        seed = body.get("seed")
        return SamplingParams(n=n, temperature=temperature, top_p=_number(body, "top_p", d.top_p),
                              top_k=int(_number(body, "top_k", d.top_k)), max_tokens=max_tokens,
                              seed=None if seed is None else int(seed), logprobs=False)

    def prompt_ids_for(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError("messages must be a non-empty list of {'role': str, 'content': str}")
        text = self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                  add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.defaults.prompt_length:
            raise RequestError(f"the judge prompt has {len(ids)} tokens, over reward.reward_model.rollout."
                               f"prompt_length={self.defaults.prompt_length}")
        return ids

    def complete(self, body: dict) -> dict:
        """One chat-completions request, answered in OpenAI's response shape (blocks until generated)."""
        pending = _Pending(self.prompt_ids_for(body), self.sampling_for(body))
        self._queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        choices, total = [], 0
        for i, (ids, finish) in enumerate(pending.result):
            total += len(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": finish if finish in ("stop", "length") else "stop"})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": str(body.get("model") or "genrm"), "choices": choices,
                "usage": {"prompt_tokens": len(pending.prompt_ids), "completion_tokens": total,
                          "total_tokens": len(pending.prompt_ids) + total}}

    # ------------------------------------------------------------------ batching
    def _dispatch_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            # Collect what arrives while requests keep coming: a reward manager's rows land within milliseconds.
            while True:
                try:
                    item = self._queue.get(timeout=self.batch_window_s)
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            self._attached.wait()
            groups: dict[tuple, list[_Pending]] = {}
            for p in batch:  # one generation call per distinct sampling setting
                key = (p.params.n, p.params.temperature, p.params.top_p, p.params.top_k, p.params.max_tokens,
                       p.params.seed)
                groups.setdefault(key, []).append(p)
            for members in groups.values():
                self._run(members)

    def _run(self, members: list[_Pending]) -> None:
        start = time.perf_counter()
        try:
            outputs = self._backend([p.prompt_ids for p in members], members[0].params)
            for p, out in zip(members, outputs, strict=True):
                p.result = out
        except BaseException as err:  # every waiting request gets the failure, none hangs
            for p in members:
                p.error = err
        finally:
            with self._lock:
                self._stats["requests"] += len(members)
                self._stats["generate_calls"] += 1
                self._stats["generate_s"] += time.perf_counter() - start
                self._stats["completion_tokens"] += sum(len(ids) for p in members for ids, _ in (p.result or []))
            for p in members:
                p.done.set()


def _number(body: dict, key: str, default):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key} must be a number, got {value!r}")
    return value


def _handler_for(router: GenRMRouter):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # one line per request would flood the training log
            pass

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._reply(404, {"error": {"message": f"no route {self.path}; the GenRM router serves "
                                                      "/v1/chat/completions"}})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                self._reply(200, router.complete(body))
            except (RequestError, json.JSONDecodeError) as err:
                self._reply(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
            except Exception as err:  # the judge failed: the caller's reward function reports it
                self._reply(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}})

    return Handler
