"""Tool agent loop over a scripted fake engine: masks, limits, errors, truncation, metrics, batching."""

import asyncio
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.experimental.agent_loop import AgentLoopManager
from verl.models.tiny import build_tiny_tokenizer
from verl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from verl.tools.calculator_tool import CalculatorTool
from verl.workers.rollout.base import BaseRollout, GenerationOutput

LOGPROB = -0.5


def call(expr, name="calculator"):
    return f"<tool_call><function={name}><parameter=expression>{expr}</parameter></function></tool_call>"


class ScriptedEngine(BaseRollout):
    """Replies by conversation (found by a key in the prompt) and turn (assistant headers seen so far)."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tok, self.script, self.calls = tokenizer, script, []

    def generate(self, requests, params):
        self.calls.append((len(requests), params))
        outs = []
        for req in requests:
            text = self.tok.decode(req.prompt_token_ids)
            key = next(k for k in self.script if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.script[key][min(turn, len(self.script[key]) - 1)]
            ids = self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id]
            reason = "stop"
            if len(ids) > params.max_tokens:
                ids, reason = ids[: params.max_tokens], "length"
            outs.append([GenerationOutput(ids, [LOGPROB] * len(ids), reason)])
        return outs

    def update_weights(self, weights, **kwargs):
        pass


class BoomTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("kaboom")


class SlowTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(5)
        return ToolResponse(text="late"), 0.0, {}


class LongTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="A" * 30 + "M" * 30 + "Z" * 30), 0.0, {}


def schema(name):
    return OpenAIFunctionToolSchema.model_validate(
        {"type": "function",
         "function": {"name": name, "parameters": {"properties": {"expression": {"type": "string"}}}}}
    )


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def make_config(**mt):
    multi_turn = dict(enable=True, format="qwen3_coder", max_assistant_turns=None, max_user_turns=None,
                      max_parallel_calls=2, max_tool_response_length=256, tool_response_truncate_side="middle")
    multi_turn.update(mt)
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 512, "response_length": 768, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "do_sample": False},
        "multi_turn": multi_turn}}})


def rows(*questions, **extra):
    return [{"raw_prompt": [{"role": "user", "content": q}], **extra} for q in questions]


def run(tok, script, questions, tools=None, **mt):
    tools = [CalculatorTool(config={})] if tools is None else tools
    engine = ScriptedEngine(tok, script)
    mgr = AgentLoopManager(make_config(**mt), engine, tok, tools=tools)
    outs, n_calls = mgr.run_rows(rows(*questions), mgr.sampling_params())
    return mgr, engine, outs, n_calls


def segments(tok, out):
    """Decode the masked-in (model) and masked-out (inserted) parts of a response."""
    model = [t for t, m in zip(out.response_ids, out.response_mask) if m == 1]
    inserted = [t for t, m in zip(out.response_ids, out.response_mask) if m == 0]
    return tok.decode(model), tok.decode(inserted)


def test_tool_round_trip_masks_and_logprobs(tok):
    script = {"Q1": [call("6*7"), "The answer is 42."]}
    _, engine, (out,), _ = run(tok, script, ["Q1"])
    model_text, inserted = segments(tok, out)
    assert model_text == call("6*7") + "<|im_end|>" + "The answer is 42.<|im_end|>"
    assert inserted == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert out.num_turns == 4  # prompt, assistant, tool, assistant
    assert all((lp == LOGPROB) == (m == 1) for lp, m in zip(out.response_logprobs, out.response_mask))
    assert out.metrics["num_tool_calls"] == 1 and out.metrics["tool_call_failures"] == 0
    # The rollout sequence equals the chat template rendering of the same conversation.
    full = tok.decode(out.prompt_ids + out.response_ids)
    convo = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": call("6*7")},
             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "The answer is 42."}]
    tools = [CalculatorTool(config={}).tool_schema.model_dump(exclude_none=True)]
    # (the final turn separator after <|im_end|> is never generated, so it is absent at the very end)
    assert full + "\n" == tok.apply_chat_template(convo, tools=tools, tokenize=False)


def test_engine_calls_batched_per_turn(tok):
    script = {"QA": [call("1+1"), call("2+2"), "done"], "QB": [call("3"), "done"], "QC": ["plain"]}
    _, engine, outs, n_calls = run(tok, script, ["QA", "QB", "QC"])
    assert [c[0] for c in engine.calls] == [3, 2, 1] and n_calls == 3
    assert [o.num_turns for o in outs] == [6, 4, 2]


def test_assistant_turn_limit(tok):
    script = {"Q": [call("1")] * 10}
    _, _, (out,), _ = run(tok, script, ["Q"], max_assistant_turns=2)
    assert out.num_turns == 4 and out.metrics["num_tool_calls"] == 1


def test_user_turn_limit(tok):
    script = {"Q": [call("1")] * 10}
    _, _, (out,), _ = run(tok, script, ["Q"], max_user_turns=3)
    assert out.num_turns == 1 + 4 + 3


def test_tool_errors_are_returned_to_model(tok):
    tools = [BoomTool({}, schema("boom")), SlowTool({"timeout": 0.05}, schema("slow"))]
    script = {"Q": [call("1", "boom") + call("1", "slow"), call("1", "ghost"), "<tool_call><function=boom>", "ok"]}
    _, _, (out,), _ = run(tok, script, ["Q"], tools=tools)
    _, inserted = segments(tok, out)
    assert "Error executing tool 'boom': RuntimeError: kaboom" in inserted
    assert "timed out" in inserted
    assert "unknown function 'ghost'" in inserted
    assert "unclosed <tool_call>" in inserted
    assert out.metrics["tool_call_failures"] == 2 and out.metrics["tool_parse_errors"] == 2
    assert out.num_turns == 1 + 4 + 3


def test_a_blocking_tool_is_cut_off_and_a_flood_truncated(tok):
    """A plain function that blocks (a hung HTTP call, an endless loop) runs in a thread, so the tool's timeout
    cuts it off; a tool answering with megabytes is cut to max_tool_response_length; the episode goes on."""
    import time

    from verl.tools.function_tool import FunctionTool

    def hang(expression: str) -> str:
        time.sleep(3)
        return "never seen"

    def flood(expression: str) -> str:
        return "A" * 3_000_000 + "Z" * 3_000_000

    tools = [FunctionTool(hang, schema("hang"), config={"timeout": 0.2}), FunctionTool(flood, schema("flood"))]
    script = {"Q": [call("1", "hang"), call("1", "flood"), "done"]}
    t0 = time.perf_counter()
    _, _, (out,), _ = run(tok, script, ["Q"], tools=tools, max_tool_response_length=64)
    assert time.perf_counter() - t0 < 2.5  # the 3 s call was not waited for
    model, inserted = segments(tok, out)
    assert "Error: tool 'hang' timed out after 0.2s" in inserted and "never seen" not in inserted
    assert f"<tool_response>\n{'A' * 32}...(truncated)...{'Z' * 32}\n</tool_response>" in inserted
    assert model.endswith("done<|im_end|>") and out.num_turns == 1 + 3 + 2
    assert out.metrics["tool_call_failures"] == 1


def test_max_parallel_calls(tok):
    script = {"Q": [call("1") + call("2") + call("3"), "done"]}
    _, _, (out,), _ = run(tok, script, ["Q"], max_parallel_calls=2)
    _, inserted = segments(tok, out)
    assert inserted.count("<tool_response>") == 2
    assert out.metrics["num_tool_calls"] == 2 and out.metrics["dropped_tool_calls"] == 1


@pytest.mark.parametrize(
    "side, expected",
    [("left", "(truncated)..." + "M" * 10 + "Z" * 30), ("right", "A" * 30 + "M" * 10 + "...(truncated)"),
     ("middle", "A" * 20 + "...(truncated)..." + "Z" * 20)],
)
def test_truncation_sides(tok, side, expected):
    script = {"Q": [call("1", "long"), "done"]}
    _, _, (out,), _ = run(tok, script, ["Q"], tools=[LongTool({}, schema("long"))], max_tool_response_length=40,
                          tool_response_truncate_side=side)
    _, inserted = segments(tok, out)
    assert f"<tool_response>\n{expected}\n</tool_response>" in inserted


def test_response_length_budget(tok):
    script = {"Q": [call("1")] * 50}
    mgr, _, (out,), _ = run(tok, script, ["Q"])
    assert len(out.response_ids) == 768 == len(out.response_mask) == len(out.response_logprobs)


def test_bad_truncate_side_rejected(tok):
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        run(tok, {"Q": ["x"]}, ["Q"], tool_response_truncate_side="sideways")


def test_generate_sequences_dataproto(tok):
    from verl.protocol import DataProto

    script = {"Q1": [call("2+3"), "5"], "Q2": ["no tools"]}
    engine = ScriptedEngine(tok, script)
    cfg = make_config()
    cfg.actor_rollout_ref.rollout.prompt_length = 500
    cfg.actor_rollout_ref.rollout.response_length = 128
    mgr = AgentLoopManager(cfg, engine, tok, tools=[CalculatorTool(config={})])
    raw = np.empty(2, dtype=object)
    raw[0], raw[1] = [{"role": "user", "content": "Q1"}], [{"role": "user", "content": "Q2"}]
    tk = np.array([{"calculator": {"create_kwargs": {"ground_truth": "5"}}}, {}], dtype=object)
    prompts = DataProto.from_dict(non_tensors={"raw_prompt": raw, "tools_kwargs": tk}, meta_info={"validate": True})
    out = mgr.generate_sequences(prompts)
    b = out.batch
    assert b["prompts"].shape == (2, 500) and b["responses"].shape == (2, 128)
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == (2, 628)
    pad = tok.pad_token_id
    assert (b["prompts"][:, 0] == pad).all() and (b["responses"][1, -1] == pad)  # left / right padding
    assert engine.calls[0][1].temperature == 0.0  # validate -> greedy val_kwargs
    # response_mask: 1 only on generated tokens; tool tokens and padding are 0.
    rm, resp = b["response_mask"], b["responses"]
    assert tok.decode(resp[0][rm[0] == 1].tolist()) == call("2+3") + "<|im_end|>5<|im_end|>"
    assert "<tool_response>" in tok.decode(resp[0][(rm[0] == 0) & (b["attention_mask"][0, 500:] == 1)].tolist())
    assert torch.equal(b["rollout_log_probs"] != 0, rm == 1)
    # positions count attended tokens only
    am = b["attention_mask"][0]
    assert b["position_ids"][0][am == 1].tolist() == list(range(int(am.sum())))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 2]
    assert out.non_tensor_batch["tool_rewards"].tolist() == [1.0, 0.0]
    agg = out.meta_info["agent_loop_metrics"]
    assert agg["agent_loop/num_tool_calls/mean"] == 0.5 and agg["agent_loop/engine_calls"] == 2
    assert out.meta_info["metrics"][0]["num_tool_calls"] == 1


def test_single_turn_agent_default(tok):
    cfg = make_config(enable=False)
    engine = ScriptedEngine(tok, {"Q": [call("1")]})
    mgr = AgentLoopManager(cfg, engine, tok, tools=[])
    (out,), _ = mgr.run_rows(rows("Q"), mgr.sampling_params())
    assert out.num_turns == 2 and all(m == 1 for m in out.response_mask)
    with pytest.raises(ValueError, match="not a registered agent loop"):
        mgr.run_rows(rows("Q", agent_name="nope"), mgr.sampling_params())


def test_engine_error_propagates(tok):
    class Broken(ScriptedEngine):
        def generate(self, requests, params):
            raise RuntimeError("engine down")

    mgr = AgentLoopManager(make_config(), Broken(tok, {}), tok, tools=[])
    with pytest.raises(RuntimeError, match="engine down"):
        mgr.run_rows(rows("Q", "R"), mgr.sampling_params())


def test_arguments_typed_by_schema_reach_tool(tok):
    seen = []

    class Echo(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            seen.append(parameters)
            return ToolResponse(text=json.dumps(parameters)), 0.0, {}

    sch = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "echo", "parameters": {
        "properties": {"n": {"type": "integer"}, "flag": {"type": "boolean"}}}}})
    text = ("<tool_call><function=echo><parameter=n>3</parameter>"
            "<parameter=flag>false</parameter></function></tool_call>")
    run(tok, {"Q": [text, "done"]}, ["Q"], tools=[Echo({}, sch)])
    assert seen == [{"n": 3, "flag": False}]


def test_sampling_params_follow_config(tok):
    mgr = AgentLoopManager(make_config(), ScriptedEngine(tok, {}), tok, tools=[])
    train = mgr.sampling_params({})
    assert train.temperature == 1.0 and train.stop_token_ids == [tok.eos_token_id] and train.max_tokens == 768
    assert mgr.sampling_params({"validate": True}).greedy
    assert mgr.sampling_params({"do_sample": False, "seed": 3}).greedy
    assert mgr.sampling_params({"seed": 3}).seed == 3


@pytest.mark.slow  # ~40 s on 2 shared cores: real generation through the tiny model
def test_hf_engine_smoke(tok):
    """The real hf engine on a tiny random model: the loop runs and shapes/masks are consistent."""
    pytest.importorskip("verl.workers.rollout.hf_rollout")
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.rollout.hf_rollout import HFRollout

    model = build_tiny_qwen3_5(kind="dense")
    cfg = make_config(max_assistant_turns=2)
    cfg.actor_rollout_ref.rollout.response_length = 24
    engine = HFRollout(cfg.actor_rollout_ref.rollout, model.config, tok, module=model)
    mgr = AgentLoopManager(cfg, engine, tok, tools=[CalculatorTool(config={})])
    outs, _ = mgr.run_rows(rows("Q1", "Q2"), mgr.sampling_params({"seed": 0}))
    tensors, _, _ = mgr.postprocess(outs)
    assert tensors["responses"].shape == (2, 24)
    assert ((tensors["rollout_log_probs"] != 0) <= (tensors["response_mask"] == 1)).all()
