"""Multi-turn tool calling: generate, parse tool calls, run tools, append their responses, repeat.

The response sequence interleaves model tokens (mask 1, with log-probs) and tokens the loop inserts (mask 0):
the template's turn separator, tool responses, parse/tool errors and the next assistant header. Limits come
from ``actor_rollout_ref.rollout.multi_turn`` (upstream keys): ``max_assistant_turns``, ``max_user_turns``,
``max_parallel_calls``, ``max_tool_response_length`` (characters) and ``tool_response_truncate_side``;
``format`` picks the tool parser. Per-tool ``config.timeout`` (seconds, default 30) bounds each call.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from verl.utils.chat_template import apply_chat_template

from verl.utils.config import cfg_get

from .agent_loop import AgentLoopBase, AgentLoopOutput, register
from .tool_parser import FunctionCall, ToolParser
from .utils import TRUNCATION_SIDES, truncate_text

logger = logging.getLogger(__name__)

DEFAULT_TOOL_TIMEOUT_S = 30.0


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mt = cfg_get(self.rollout_config, "multi_turn")
        self.max_assistant_turns = cfg_get(mt, "max_assistant_turns")
        self.max_user_turns = cfg_get(mt, "max_user_turns")
        self.max_parallel_calls = int(cfg_get(mt, "max_parallel_calls", 1))
        self.max_tool_response_length = int(cfg_get(mt, "max_tool_response_length", 256))
        self.truncate_side = cfg_get(mt, "tool_response_truncate_side", "middle")
        if self.truncate_side not in TRUNCATION_SIDES:
            raise ValueError(f"multi_turn.tool_response_truncate_side must be one of {TRUNCATION_SIDES}")
        self.tool_parser = ToolParser.get_tool_parser(cfg_get(mt, "format", "hermes"), self.tokenizer)
        self.tool_schemas = [t.tool_schema.model_dump(exclude_none=True) for t in self.tools.values()]
        self.turn_separator = self._turn_separator()

    def _turn_separator(self) -> list[int]:
        """Tokens the template puts after an end-of-turn token (Qwen: "\\n"); the model stops before them."""
        turn = {"role": "user", "content": "x"}
        one = apply_chat_template(self.tokenizer, [turn], tokenize=True, add_generation_prompt=False)
        two = apply_chat_template(self.tokenizer, [turn, turn], tokenize=True, add_generation_prompt=False)
        if list(two[: len(one)]) != list(one):
            return []
        second = list(two[len(one) :])
        eos = self.tokenizer.eos_token_id
        if eos in second:
            idx = len(second) - 1 - second[::-1].index(eos)
            return second[idx + 1 :]
        return []

    async def run(self, **kwargs) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        tools_kwargs: dict[str, Any] = dict(kwargs.get("tools_kwargs") or {})
        prompt_ids, mm_inputs = self.prepare_prompt(messages, self.tool_schemas or None, kwargs.get("multi_modal_data"))

        engine_mm = self.engine_multi_modal_data(kwargs.get("multi_modal_data"), mm_inputs)
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        metrics = {"num_tool_calls": 0.0, "tool_call_failures": 0.0, "tool_parse_errors": 0.0,
                   "dropped_tool_calls": 0.0}
        instances: dict[str, str] = {}
        assistant_turns = user_turns = 0

        try:
            while True:
                budget = self.response_length - len(response_ids)
                if budget <= 0:
                    break
                out = await self.server.generate(prompt_ids + response_ids, budget, engine_mm)
                gen = list(out.token_ids)[:budget]
                response_ids += gen
                mask += [1] * len(gen)
                lp = list(out.log_probs)[: len(gen)] if out.log_probs is not None else [0.0] * len(gen)
                logprobs += lp + [0.0] * (len(gen) - len(lp))
                assistant_turns += 1
                if out.finish_reason == "length" or len(response_ids) >= self.response_length:
                    break
                if self.max_assistant_turns and assistant_turns >= self.max_assistant_turns:
                    break
                if self.max_user_turns and user_turns >= self.max_user_turns:
                    break

                parsed = await self.tool_parser.parse(gen, self.tool_schemas or None)
                if not parsed.calls and not parsed.errors:
                    break  # a plain answer ends the episode
                metrics["tool_parse_errors"] += len(parsed.errors)
                calls = parsed.calls[: self.max_parallel_calls]
                metrics["dropped_tool_calls"] += len(parsed.calls) - len(calls)
                metrics["num_tool_calls"] += len(calls)
                texts = await asyncio.gather(
                    *(self._call_tool(c, tools_kwargs, instances, metrics) for c in calls)
                )
                texts = list(texts) + [f"Error: could not parse tool call: {e}" for e in parsed.errors]
                tool_messages = [
                    {"role": "tool", "content": truncate_text(t, self.max_tool_response_length, self.truncate_side)}
                    for t in texts
                ]
                inserted = self._tool_turn_tokens(gen, tool_messages)
                room = self.response_length - len(response_ids)
                response_ids += inserted[:room]
                mask += [0] * min(len(inserted), room)
                logprobs += [0.0] * min(len(inserted), room)
                user_turns += 1
                if len(inserted) >= room:
                    break  # no room left for another assistant turn
            tool_reward = await self._finish_tools(instances, tools_kwargs)
        except BaseException:
            await self._release(instances)
            raise

        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=logprobs,
            num_turns=user_turns + assistant_turns + 1,
            metrics=metrics,
            extra_fields={"tool_reward": tool_reward} if instances else {},
            multi_modal_inputs=mm_inputs,
        )

    def _tool_turn_tokens(self, generated: list[int], tool_messages: list[dict]) -> list[int]:
        """Close the assistant turn like the template would, then the tool turn and next assistant header."""
        eos = self.tokenizer.eos_token_id
        prefix = ([] if generated and generated[-1] == eos else [eos]) + list(self.turn_separator)
        body = apply_chat_template(
            self.tokenizer, tool_messages, add_generation_prompt=True, tokenize=True, **self.apply_chat_template_kwargs
        )
        return prefix + list(body)

    async def _call_tool(self, call: FunctionCall, tools_kwargs: dict, instances: dict, metrics: dict) -> str:
        """Run one call; every failure becomes text for the model and counts as a tool call failure."""
        tool = self.tools.get(call.name)
        if tool is None:
            metrics["tool_call_failures"] += 1
            return f"Error: unknown tool {call.name!r}; available: {sorted(self.tools)}"
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            metrics["tool_call_failures"] += 1
            return f"Error: arguments for {call.name!r} must be a JSON object"
        kw = tools_kwargs.get(call.name) or {}
        timeout = float(tool.config.get("timeout", DEFAULT_TOOL_TIMEOUT_S))
        try:
            if call.name not in instances:
                inst, _ = await asyncio.wait_for(tool.create(**(kw.get("create_kwargs") or {})), timeout)
                instances[call.name] = inst
            resp, _, _ = await asyncio.wait_for(
                tool.execute(instances[call.name], args, **(kw.get("execute_kwargs") or {})), timeout
            )
        except asyncio.TimeoutError:
            metrics["tool_call_failures"] += 1
            return f"Error: tool {call.name!r} timed out after {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - a tool bug must not kill the rollout; the model sees the error
            logger.warning("tool %r raised %s: %s", call.name, type(e).__name__, e)
            metrics["tool_call_failures"] += 1
            return f"Error executing tool {call.name!r}: {type(e).__name__}: {e}"
        text = resp.text if resp is not None and resp.text is not None else ""
        if resp is not None and (resp.image or resp.video):
            text += "\n(non-text tool output omitted)"
        return text

    async def _finish_tools(self, instances: dict[str, str], tools_kwargs: dict) -> float:
        total = 0.0
        try:
            for name, inst in instances.items():
                kw = (tools_kwargs.get(name) or {}).get("calc_reward_kwargs") or {}
                total += float(await self.tools[name].calc_reward(inst, **kw))
        finally:
            await self._release(instances)
        return total

    async def _release(self, instances: dict[str, str]) -> None:
        for name, inst in instances.items():
            try:
                await self.tools[name].release(inst)
            except Exception as e:  # noqa: BLE001 - cleanup failures are logged, the trajectory is kept
                logger.warning("releasing tool %r failed: %s", name, e)
