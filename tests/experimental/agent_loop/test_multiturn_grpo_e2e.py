"""Multi-turn tool-calling GRPO through ``python -m verl.trainer.main_ppo`` on the tiny Qwen3.5, on CPU.

Two runs of the real CLI (in-process ``trainer.launcher=local``) with ``rollout.multi_turn`` enabled, the
``qwen3_coder`` (Qwen3.5 XML) parser, the example calculator tool config and GSM8K-with-tool rows built by
``examples/data_preprocess/gsm8k_w_tool.py``:

* the random demo model: the tool config is loaded (the tools block is in every rollout prompt), the
  agent-loop metrics are logged, the losses are finite;
* a copy of the tiny model first fine-tuned for a few dozen steps to answer with a calculator call. A random
  model almost never writes a valid XML call, so this makes the tool path deterministic: the run must execute
  real calls, the batch the actor trains on must mask the tool-response tokens out (0) and keep the model's
  tokens in (1), and ``agent_loop/num_tool_calls`` must be logged > 0.

The actor's training batch is observed through a ``sitecustomize`` module put on the subprocess's
``PYTHONPATH``: it wraps ``PPOActor.update_policy`` to save its inputs and changes nothing else.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import torch

from tests.trainer.e2e_utils import REPO, run_main_ppo, train_records

TOOL_CONFIG = REPO / "examples" / "sglang_multiturn" / "config" / "tool_config" / "calculator_tool_config.yaml"
CALL = "<tool_call><function=calculator><parameter=expression>1+2</parameter></function></tool_call>"
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
TOOL_HEAD, TOOL_TAIL = "\n<|im_start|>user\n<tool_response>\n", "</tool_response><|im_end|>\n<|im_start|>assistant\n"

MULTI_TURN = [
    "trainer.launcher=local",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.total_training_steps=2",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.multi_turn.format=qwen3_coder",
    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    # The dataset renders prompts without the tools block; the agent loop adds it (~420 more tokens with the
    # character-level tiny tokenizer), so the rollout prompt budget must hold both.
    "data.max_prompt_length=768",
    "data.max_response_length=96",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
]

OBSERVER = '''"""Test observer: saves what the actor trains on, then calls the real update."""
import os

_dump = os.environ.get("VERL_TEST_ACTOR_DUMP")
if _dump:
    import torch
    from verl.workers.actor import ppo_actor

    _orig = ppo_actor.PPOActor.update_policy
    _seen = []

    def update_policy(self, data):
        keys = ("responses", "response_mask", "attention_mask")
        _seen.append({k: data.batch[k].detach().clone() for k in keys})
        torch.save(_seen, _dump)
        return _orig(self, data)

    ppo_actor.PPOActor.update_policy = update_policy
'''


def _gsm8k_w_tool():
    path = REPO / "examples" / "data_preprocess" / "gsm8k_w_tool.py"
    spec = importlib.util.spec_from_file_location("gsm8k_w_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_rows(path: Path, pairs: list[tuple[int, int]]) -> list[dict]:
    """GSM8K-with-tool rows (system prompt, agent_name=tool_agent, tools_kwargs) for "What is a+b?"."""
    import pandas as pd

    g = _gsm8k_w_tool()
    rows = [g.make_row({"question": f"What is {a}+{b}?", "answer": f"{a}+{b}={a + b} #### {a + b}"}, "train", i)
            for i, (a, b) in enumerate(pairs)]
    pd.DataFrame(rows).to_parquet(path)
    return rows


def tool_schemas() -> list[dict]:
    from verl.tools.tool_registry import initialize_tools_from_config

    return [t.tool_schema.model_dump(exclude_none=True) for t in initialize_tools_from_config(str(TOOL_CONFIG))]


def data_overrides(train: Path) -> list[str]:
    return [f"data.train_files={train}", f"data.val_files={train}"]


def test_multiturn_grpo_cli_with_calculator(tmp_path):
    """Random tiny model: the multi-turn run completes with the tool config loaded and metrics logged."""
    from verl.models.tiny import build_tiny_tokenizer
    from verl.utils.chat_template import apply_chat_template

    train = tmp_path / "train.parquet"
    rows = write_rows(train, [(i + 1, 2 * i + 3) for i in range(8)])
    _, records = run_main_ppo(tmp_path / "run", MULTI_TURN + data_overrides(train))
    steps = train_records(records)
    assert sorted(steps) == [1, 2]
    # Rollout prompts are rendered by the agent loop WITH the calculator schema (the dataset's are not).
    tok, schemas = build_tiny_tokenizer(), tool_schemas()
    with_tools = [len(apply_chat_template(tok, r["prompt"], tools=schemas, tokenize=True)) for r in rows]
    assert min(with_tools) > 600
    for s in steps.values():
        assert min(with_tools) <= s["prompt_length/min"] and s["prompt_length/max"] <= max(with_tools)
        for key in ("agent_loop/num_tool_calls/mean", "agent_loop/tool_call_failures/mean",
                    "agent_loop/tool_parse_errors/mean", "agent_loop/num_turns/mean", "agent_loop/engine_calls",
                    "actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert key in s and math.isfinite(s[key]), key
        assert s["agent_loop/num_turns/min"] >= 2  # prompt + at least one assistant turn


def test_rollout_metrics_merge_across_data_parallel_ranks():
    """Ranks report different agent-loop numbers; gathering their outputs must merge, not conflict."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl.protocol import DataProto
    from verl.single_controller.decorator import Dispatch
    from verl.single_controller.worker_group import collect_results
    from verl.trainer.ppo.ray_trainer import _combine_agent_loop_metrics
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class FakeLoop:
        def __init__(self, calls):
            self.calls = calls

        def generate_sequences(self, prompts):
            c = self.calls
            return DataProto.from_dict(
                tensors={"responses": torch.zeros(2, 3, dtype=torch.long)},
                meta_info={"metrics": [{"num_tool_calls": c}] * 2,
                           "agent_loop_metrics": {"agent_loop/num_tool_calls/mean": c,
                                                  "agent_loop/num_tool_calls/max": c,
                                                  "agent_loop/num_turns/min": 2 + c}})

    def rank_output(calls):
        cfg = OmegaConf.create({"rollout": {"response_length": 3}})
        no_cycle = SimpleNamespace(before_generate=lambda: None, after_generate=lambda: None, last_sync_s=0.0)
        worker = SimpleNamespace(agent_loop=FakeLoop(calls), config=cfg, rollout_cycle=no_cycle,
                                 rollout=SimpleNamespace(),  # an engine without memory metrics (the hf one)
                                 _trace_recorder=None, _rollout_group=None, _dp_layout=None)  # one rank's engine
        # the real per-token weight-version stamp (a synchronous worker has no weight_version: it stamps nothing)
        worker._stamp_weight_version = lambda out: ActorRolloutRefWorker._stamp_weight_version(worker, out)
        prompts = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 4, dtype=torch.long)},
                                      meta_info={"global_steps": 1})
        return ActorRolloutRefWorker.generate_sequences(worker, prompts)

    merged = collect_results(Dispatch.DP_COMPUTE_PROTO, [rank_output(0.0), rank_output(2.0)])
    assert len(merged) == 4
    assert _combine_agent_loop_metrics(merged.meta_info["metrics"]) == {
        "agent_loop/num_tool_calls/mean": 1.0, "agent_loop/num_tool_calls/max": 2.0, "agent_loop/num_turns/min": 2.0}


def nudge_to_call_calculator(out_dir: Path, steps: int = 80) -> None:
    """Fine-tune the tiny model on one tool-calling conversation; save it (with tokenizer) to ``out_dir``."""
    from verl.models.tiny import build_tiny_tokenizer
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    tok, schemas = build_tiny_tokenizer(), tool_schemas()
    model = build_tiny_qwen3_5(kind="dense", seed=0)
    prompt = _gsm8k_w_tool().make_row({"question": "What is 1+2?", "answer": "#### 3"}, "train", 0)["prompt"]
    convo = prompt + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "3"},
                      {"role": "assistant", "content": "#### 3"}]
    head = tok.apply_chat_template(prompt, tools=schemas, add_generation_prompt=True, tokenize=False)
    # What the agent loop produces: the rollout ends at the last <|im_end|>, without the turn separator.
    full = tok.apply_chat_template(convo, tools=schemas, tokenize=False).removesuffix("\n")
    assert full.startswith(head) and full[len(head):] == CALL + "<|im_end|>" + TOOL_TURN + "#### 3<|im_end|>"
    ids = torch.tensor([tok.encode(full, add_special_tokens=False)])
    labels = ids.clone()
    labels[:, : len(tok.encode(head, add_special_tokens=False))] = -100
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))


def test_nudged_model_calls_calculator_and_tool_tokens_are_masked(tmp_path):
    """A model that emits calculator calls: real tool turns, masked out of the actor's loss, metrics > 0."""
    from verl.models.tiny import build_tiny_tokenizer

    model_dir = tmp_path / "nudged"
    nudge_to_call_calculator(model_dir)
    train = tmp_path / "train.parquet"
    write_rows(train, [(1, 2)] * 6 + [(2, 2)] * 2)  # the model always computes 1+2: right for most rows
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(OBSERVER)
    dump = tmp_path / "actor_batches.pt"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p),
           "VERL_TEST_ACTOR_DUMP": str(dump)}
    overrides = MULTI_TURN + data_overrides(train) + [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-5",  # keep the nudged behaviour for both steps
    ]
    _, records = run_main_ppo(tmp_path / "run", overrides, env_extra=env)
    steps = train_records(records)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        assert s["agent_loop/num_tool_calls/mean"] > 0
        assert s["agent_loop/num_tool_calls/max"] >= 1
        assert s["agent_loop/num_turns/max"] >= 4  # prompt, assistant (call), tool, assistant
        assert math.isfinite(s["actor/pg_loss"]) and math.isfinite(s["actor/grad_norm"])
    # "#### 3" written after the tool turn reached the reward (sampling is not seeded: any step will do).
    assert max(s["critic/score/max"] for s in steps.values()) == 1.0

    tok = build_tiny_tokenizer()
    call_ids = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    turn_ids = tok.encode(TOOL_TURN, add_special_tokens=False)
    batches = torch.load(dump)
    assert len(batches) == 2  # one actor update per step
    clean_calls = 0
    for b in batches:
        responses, mask = b["responses"], b["response_mask"]
        resp_attn = b["attention_mask"][:, -responses.shape[1]:]
        assert ((mask == 1) <= (resp_attn == 1)).all()  # padding never counts
        for row, row_mask, row_attn in zip(responses.tolist(), mask.tolist(), resp_attn.tolist()):
            # Every masked-out stretch is a tool turn the loop inserted (possibly cut by the length budget);
            # the model may write tool-response-like text itself, which is its own output and stays in.
            for start, end in _runs(row_mask, row_attn, value=0):
                text = tok.decode(row[start:end]).removeprefix("<|im_end|>")
                if end == len(row) or row_attn[end] == 0:  # the budget may cut the last tool turn anywhere
                    assert text.startswith(TOOL_HEAD) or TOOL_HEAD.startswith(text), text
                else:
                    assert text.startswith(TOOL_HEAD) and text.endswith(TOOL_TAIL), text
            if row[: len(call_ids)] == call_ids:
                # A well-formed call: trained on; the calculator's answer "3": not; the reply after it: trained on.
                clean_calls += 1
                n, m = len(call_ids), len(turn_ids)
                assert row_mask[:n] == [1] * n
                assert row[n : n + m] == turn_ids and row_mask[n : n + m] == [0] * m
                assert row_attn[n + m] == 0 or row_mask[n + m] == 1
    assert clean_calls >= 2


def _runs(mask: list[int], attn: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) stretches of attended positions whose mask equals ``value``."""
    runs, start = [], None
    for i, (m, a) in enumerate(zip(mask, attn)):
        if a == 1 and m == value:
            start = i if start is None else start
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def test_example_script_overrides_compose():
    """examples/grpo_trainer/run_qwen3_5-9b_multiturn_calculator.sh passes only valid keys and values."""
    import shlex

    from verl.trainer.config.checks import compose_config

    script = (REPO / "examples" / "grpo_trainer" / "run_qwen3_5-9b_multiturn_calculator.sh").read_text()
    # From the module on: the interpreter is the script's "$PYTHON" (tests/test_docs_commands.py checks it).
    command = script[script.index("-m verl.trainer.main_ppo"):].replace("\\\n", " ").replace('"$@"', "")
    for var, value in {"$DATA_DIR": "/data", "$MODEL_PATH": "/model", "$TOOL_CONFIG": str(TOOL_CONFIG),
                       "$NGPUS": "8"}.items():
        command = command.replace(var, value)
    overrides = shlex.split(command)[2:]
    cfg = compose_config("ppo_trainer", overrides, validate=True)
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.format == "qwen3_coder" and mt.tool_config_path == str(TOOL_CONFIG)
