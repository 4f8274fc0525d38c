"""The GenRM router: OpenAI chat-completions in, batched judge calls out, refusals by field name."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from verl.workers.reward_model.genrm_router import GenRMRouter, JudgeDefaults


@pytest.fixture(scope="module")
def tokenizer():
    from verl.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _post(router, body, path="/v1/chat/completions"):
    req = urllib.request.Request(f"http://{router.address}{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _router(tokenizer, backend, **defaults):
    router = GenRMRouter(tokenizer, JudgeDefaults(**{"temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                                     "response_length": 32, "prompt_length": 64, **defaults}),
                         batch_window_s=0.2)
    router.attach(backend)
    return router


def test_concurrent_requests_are_batched_and_answered_in_order(tokenizer):
    calls = []

    def backend(prompts, params):
        calls.append((prompts, params))
        # Echo each prompt's length so every caller can check it got its own answer.
        return [[(tokenizer(f"Score: {len(p)}", add_special_tokens=False)["input_ids"], "stop")] for p in prompts]

    router = _router(tokenizer, backend)
    results = {}
    questions = ["a", "bb", "ccc", "dddd"]

    def ask(q):
        results[q] = _post(router, {"messages": [{"role": "user", "content": q}], "model": "judge"})

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics = router.pop_metrics()
    router.close()

    assert len(calls) == 1 and len(calls[0][0]) == 4  # one generation call for the four requests
    prompts, params = calls[0]
    for q in questions:
        code, body = results[q]
        want_ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
        assert code == 200 and body["object"] == "chat.completion"
        assert want_ids["input_ids"] in prompts  # rendered with the judge's chat template
        assert body["choices"][0]["message"] == {"role": "assistant",
                                                 "content": f"Score: {len(want_ids['input_ids'])}"}
        assert body["choices"][0]["finish_reason"] == "stop"
    # Unset sampling fields take reward.reward_model.rollout's values.
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.n) == (0.7, 0.9, 5, 32, 1)
    assert metrics["reward/genrm/requests"] == 4 and metrics["reward/genrm/generate_calls"] == 1
    assert router.pop_metrics() == {}  # counters restart after each read


def test_request_fields_override_defaults_and_do_sample_false_is_greedy(tokenizer):
    seen = []

    def backend(prompts, params):
        seen.append(params)
        return [[([], "length")] * params.n for _ in prompts]

    router = _router(tokenizer, backend, do_sample=False)
    code, body = _post(router, {"messages": [{"role": "user", "content": "q"}]})
    assert code == 200 and seen[-1].temperature == 0.0  # rollout.do_sample=false: greedy by default
    code, body = _post(router, {"messages": [{"role": "user", "content": "q"}], "temperature": 0.3, "top_p": 0.5,
                                "top_k": 2, "max_tokens": 7, "n": 2, "seed": 3})
    router.close()
    p = seen[-1]
    assert code == 200 and (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n, p.seed) == (0.3, 0.5, 2, 7, 2, 3)
    assert len(body["choices"]) == 2 and body["choices"][1]["finish_reason"] == "length"


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "q"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "q"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 33}, "response_length"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x" * 100}]}, "prompt_length"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
])
def test_refused_requests_name_the_field(tokenizer, body, needle):
    router = _router(tokenizer, lambda prompts, params: pytest.fail("must not generate"))
    code, reply = _post(router, body)
    router.close()
    assert code == 400 and needle in reply["error"]["message"]


def test_backend_failure_reaches_every_waiting_caller(tokenizer):
    def backend(prompts, params):
        raise RuntimeError("judge out of memory")

    router = _router(tokenizer, backend)
    code, reply = _post(router, {"messages": [{"role": "user", "content": "q"}]})
    code404, _ = _post(router, {}, path="/v1/completions")
    router.close()
    assert code == 500 and "judge out of memory" in reply["error"]["message"]
    assert code404 == 404


def test_tokenizer_without_chat_template_is_refused(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        GenRMRouter(plain, JudgeDefaults())


def test_rollout_keys_are_the_judges_request_defaults_and_limits(tokenizer):
    from verl.trainer.main_ppo import load_config

    cfg = load_config(["--config-name", "demo", "reward.reward_model.rollout.temperature=0.25",
                       "reward.reward_model.rollout.top_p=0.75", "reward.reward_model.rollout.top_k=3",
                       "reward.reward_model.rollout.do_sample=true", "reward.reward_model.rollout.prompt_length=40",
                       "reward.reward_model.rollout.response_length=9"])
    seen = []
    router = GenRMRouter(tokenizer, JudgeDefaults.from_config(cfg.reward.reward_model.rollout))
    router.attach(lambda prompts, params: seen.append(params) or [[([], "stop")] for _ in prompts])
    ok, _ = _post(router, {"messages": [{"role": "user", "content": "q"}]})
    too_many, reply = _post(router, {"messages": [{"role": "user", "content": "q"}], "max_tokens": 10})
    too_long, reply2 = _post(router, {"messages": [{"role": "user", "content": "q" * 41}]})
    router.close()
    p = seen[0]
    assert ok == 200 and (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.25, 0.75, 3, 9)
    assert too_many == 400 and "reward.reward_model.rollout.response_length=9" in reply["error"]["message"]
    assert too_long == 400 and "reward.reward_model.rollout.prompt_length=40" in reply2["error"]["message"]


def test_many_simultaneous_connections_are_all_served(tokenizer):
    # More connections at once than a default listen backlog (5): none may be reset.
    router = _router(tokenizer, lambda prompts, params: [[([], "stop")] for _ in prompts])
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(_post(router, {"messages": [
        {"role": "user", "content": "q"}]})[0])) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router.close()
    assert codes == [200] * 64
