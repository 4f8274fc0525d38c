"""A ready-made generative-reward-model (GenRM) scorer: prompt template, judge call, verdict parser.

Upstream's route to a GenRM is a custom reward function that receives ``reward_router_address`` (an
OpenAI-compatible ``/v1/chat/completions`` endpoint serving ``reward.reward_model.model_path``) and
``reward_model_tokenizer``, writes the judge prompt, asks the judge, and parses its answer. This module is such a
function, so a run needs no code of its own::

    reward.reward_model.enable=true reward.reward_model.model_path=/models/judge
    reward.custom_reward_function.path=pkg://verl.utils.reward_score.genrm
    reward.custom_reward_function.name=compute_score

Options come from ``reward.custom_reward_function.reward_kwargs`` (``template``, ``score_min``, ``score_max``,
``default_score``, ``temperature``, ``top_p``, ``max_tokens``). The judge's text is untrusted model output: it is
only ever matched with regular expressions and read with ``float`` on a bounded digit string; an answer
without a usable verdict scores ``default_score`` and is reported as such (``genrm_verdict`` per response, the
trainer counts them as ``reward/genrm/*`` metrics), never an exception.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["DEFAULT_TEMPLATE", "Verdict", "VERDICT_KEY", "VERDICT_STATUSES", "chat_complete", "compute_score",
           "parse_verdict", "render_prompt"]

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\n"
    "Question:\n{problem}\n\n"
    "Answer:\n{solution}\n\n"
    "Rate how correct and helpful the answer is, from {score_min} (wrong or irrelevant) to {score_max} "
    "(fully correct). Reply with one line of the form\n"
    "Score: <number>"
)
# Placeholders a template may use; anything else in braces is left as written (a template may contain JSON or
# LaTeX), and a value's own braces are never expanded, so a response cannot inject placeholders.
_FIELDS = ("problem", "solution", "ground_truth", "score_min", "score_max")

VERDICT_KEY = "genrm_verdict"  # per-response status in the reward extras (ok / missing / malformed / out_of_range)
VERDICT_STATUSES = ("ok", "missing", "malformed", "out_of_range")

# "Score: 7", "score = 7.5", "**Score**: 7": the last such marker wins (a judge may restate the scale first).
_MARKED = re.compile(r"\bscore[*_`\s]*[:=][*_`\s]*(\S*)", re.IGNORECASE)
# A plain decimal of bounded length (so float() is always finite), optionally "out of" a scale: "7/10".
_MARKED_NUMBER = re.compile(r"([-+]?\d{1,12}(?:\.\d{1,12})?)(?:/\d{1,12})?")
_BARE = re.compile(r"[-+]?\d{1,12}(?:\.\d{1,12})?")


@dataclass(frozen=True)
class Verdict:
    """``score`` is the judge's number when ``status == "ok"``, else None."""

    score: float | None
    status: str


def render_prompt(template: str, problem: str, solution: str, ground_truth: str = "",
                  score_min: float = 1, score_max: float = 10) -> str:
    """``template`` with its ``{problem}``/``{solution}``/``{ground_truth}``/``{score_min}``/``{score_max}``
    placeholders filled in one pass. A template without ``{solution}`` is an error (the judge would not see the
    response it grades)."""
    if not isinstance(template, str) or "{solution}" not in template:
        raise ValueError(f"the GenRM template must contain {{solution}} (the response being judged); got {template!r}")
    values = {"problem": problem, "solution": solution, "ground_truth": ground_truth,
              "score_min": _num_text(score_min), "score_max": _num_text(score_max)}
    pattern = re.compile("{(" + "|".join(_FIELDS) + ")}")
    return pattern.sub(lambda m: str(values[m.group(1)]), template)


def _num_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_verdict(text, score_min: float = 1, score_max: float = 10) -> Verdict:
    """The judge's score in ``text``: the number after the last ``Score:`` marker, else a number standing alone
    on the last non-empty line (upstream's GenRM example answers with a bare integer).

    ``missing``: no marker and no bare number on the last line (or no text); ``malformed``: a marker followed by no
    plain number (``Score: ten``, ``Score: 1e999``); ``out_of_range``: a number outside ``[score_min, score_max]``."""
    if not isinstance(text, str) or not text.strip():
        return Verdict(None, "missing")
    marked = _MARKED.findall(text)
    if marked:
        number = _MARKED_NUMBER.fullmatch(marked[-1].strip("*_`\"'.,;)"))
        if number is None:
            return Verdict(None, "malformed")
        raw = number.group(1)
    else:
        last_line = [ln for ln in text.strip().splitlines() if ln.strip()][-1].strip().strip("*_`.")
        if _BARE.fullmatch(last_line) is None:
            return Verdict(None, "missing")
        raw = last_line
    value = float(raw)  # a bounded digit string: always finite
    if not (score_min <= value <= score_max):
        return Verdict(None, "out_of_range")
    return Verdict(value, "ok")


def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # the router's 4xx/5xx carry a JSON error message
        detail = err.read().decode(errors="replace")
        raise RuntimeError(f"GenRM request to {url} failed ({err.code}): {detail}") from None


async def chat_complete(router_address: str, request: dict, timeout: float = 3600.0) -> dict:
    """POST an OpenAI chat-completions ``request`` to ``http://{router_address}/v1/chat/completions``; the
    response as a dict (``choices[i].message.content``). Runs the blocking call on a thread, so many rows'
    requests are in flight at once and the router can batch them."""
    url = f"http://{router_address}/v1/chat/completions"
    return await asyncio.to_thread(_post_json, url, request, timeout)


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None,
                        reward_model_tokenizer=None, template: str = DEFAULT_TEMPLATE, score_min: float = 1,
                        score_max: float = 10, default_score: float = 0.0, temperature: float | None = None,
                        top_p: float | None = None, max_tokens: int | None = None, **kwargs) -> dict:
    """Ask the judge about one response; ``{"score", "genrm_verdict", "genrm_response"}``.

    The question is ``extra_info["question"]``, where upstream's data preprocessing (and its GenRM example)
    keeps it. Sampling options left unset take ``reward.reward_model.rollout``'s values at the router."""
    del data_source, reward_model_tokenizer, kwargs
    if not reward_router_address:
        raise ValueError("the GenRM scorer needs reward_router_address: set reward.reward_model.enable=true and "
                         "reward.reward_model.model_path to the judge model")
    if not math.isfinite(float(default_score)):
        raise ValueError(f"default_score must be a finite number, got {default_score!r}")
    info = extra_info if isinstance(extra_info, dict) else {}
    problem = info.get("question")
    if problem is None and "{problem}" in template:
        raise ValueError("the GenRM template uses {problem}, but this row's extra_info has no 'question' (upstream's "
                         "data preprocessing stores the question there); add it to the dataset or drop {problem}")
    prompt = render_prompt(template, str(problem or ""), solution_str, str(ground_truth or ""), score_min, score_max)
    request = {"messages": [{"role": "user", "content": prompt}]}
    for key, value in (("temperature", temperature), ("top_p", top_p), ("max_tokens", max_tokens)):
        if value is not None:
            request[key] = value
    reply = await chat_complete(reward_router_address, request)
    text = reply["choices"][0]["message"]["content"]
    verdict = parse_verdict(text, score_min, score_max)
    score = verdict.score if verdict.status == "ok" else float(default_score)
    return {"score": score, VERDICT_KEY: verdict.status, "genrm_response": text}
