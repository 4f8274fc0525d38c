"""The built-in GenRM scorer's prompt template and verdict parser, and the scorer against a fake judge server."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verl.utils.reward_score.genrm import DEFAULT_TEMPLATE, Verdict, compute_score, parse_verdict, render_prompt


# --------------------------------------------------------------------------- template
def test_template_fills_every_placeholder_once():
    out = render_prompt("P={problem} S={solution} G={ground_truth} [{score_min}..{score_max}]", "2+2?", "4", "4",
                        0, 1.5)
    assert out == "P=2+2? S=4 G=4 [0..1.5]"


def test_template_does_not_expand_braces_in_values_and_keeps_other_braces():
    # A response that contains a placeholder is judged verbatim, never re-expanded; JSON braces in the template stay.
    out = render_prompt('{"q": "{problem}"} -> {solution}', "{solution}", "{problem} {0} {__class__}")
    assert out == '{"q": "{solution}"} -> {problem} {0} {__class__}'


def test_default_template_shows_question_answer_and_scale():
    out = render_prompt(DEFAULT_TEMPLATE, "Repeat: A", "A", score_min=1, score_max=10)
    assert "Repeat: A" in out and "\nA\n" in out and "from 1 " in out and "to 10 " in out and "Score:" in out


@pytest.mark.parametrize("bad", ["no placeholder", "{problem} only", None])
def test_template_without_solution_is_refused(bad):
    with pytest.raises(ValueError, match=r"\{solution\}"):
        render_prompt(bad, "q", "a")


# --------------------------------------------------------------------------- parser
@pytest.mark.parametrize("text,score", [
    ("Score: 7", 7.0),
    ("The answer is right.\n**Score:** 9", 9.0),
    ("score = 3/10", 3.0),
    ("Score: 8.5.", 8.5),
    ("Scale is 1-10. Score: 4\nOn reflection, Score: 6", 6.0),  # the last marker wins
    ("Looks fine.\n\n10", 10.0),  # upstream's example: a bare number as the last paragraph
    ("  1  ", 1.0),
])
def test_parser_good_verdicts(text, score):
    assert parse_verdict(text, 1, 10) == Verdict(score, "ok")


@pytest.mark.parametrize("text", ["Score: ten", "Score: 1e999", "Score:", "Score: 7.5.5", "Score: --3",
                                  "Score: " + "9" * 40])
def test_parser_malformed_verdicts(text):
    assert parse_verdict(text, 1, 10) == Verdict(None, "malformed")


@pytest.mark.parametrize("text", ["Score: 11", "Score: 0", "Score: -2", "\n12\n"])
def test_parser_out_of_range_verdicts(text):
    assert parse_verdict(text, 1, 10) == Verdict(None, "out_of_range")


@pytest.mark.parametrize("text", ["", "   \n ", None, 42, "I think the answer is good", "7 out of 10 maybe",
                                  "__import__('os').system('true')"])
def test_parser_missing_verdicts(text):
    assert parse_verdict(text, 1, 10) == Verdict(None, "missing")


def test_parser_range_is_configurable():
    assert parse_verdict("Score: 0.25", 0, 1) == Verdict(0.25, "ok")
    assert parse_verdict("Score: 2", 0, 1) == Verdict(None, "out_of_range")


# --------------------------------------------------------------------------- scorer
class _FakeJudge:
    """A chat-completions server answering with a fixed text; records the requests."""

    def __init__(self, answer: str):
        self.requests = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                outer.requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]})
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = "%s:%d" % self.server.server_address[:2]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("answer,score,status", [("Score: 8", 8.0, "ok"), ("gibberish", -1.0, "missing"),
                                                 ("Score: 99", -1.0, "out_of_range"), ("Score: x", -1.0, "malformed")])
def test_scorer_sends_template_and_parses_the_answer(answer, score, status):
    judge = _FakeJudge(answer)
    try:
        out = asyncio.run(compute_score("src", "my answer", "gt", {"question": "the question"},
                                        reward_router_address=judge.address, reward_model_tokenizer=None,
                                        template="Q={problem} A={solution}", default_score=-1.0, temperature=0.0,
                                        max_tokens=5))
    finally:
        judge.close()
    assert out == {"score": score, "genrm_verdict": status, "genrm_response": answer}
    (path, body), = judge.requests
    assert path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "user", "content": "Q=the question A=my answer"}], "temperature": 0.0,
                    "max_tokens": 5}


def test_scorer_errors_are_clear():
    with pytest.raises(ValueError, match="reward_router_address"):
        asyncio.run(compute_score("s", "a", "g", {"question": "q"}))
    with pytest.raises(ValueError, match="'question'"):
        asyncio.run(compute_score("s", "a", "g", {}, reward_router_address="127.0.0.1:1"))
    with pytest.raises(ValueError, match="default_score"):
        asyncio.run(compute_score("s", "a", "g", {"question": "q"}, reward_router_address="127.0.0.1:1",
                                  default_score=float("nan")))
