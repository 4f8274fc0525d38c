"""The default agent loop: render the chat prompt, generate once."""

from __future__ import annotations

from .agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, **kwargs) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        prompt_ids, mm_inputs = self.prepare_prompt(messages, None, kwargs.get("multi_modal_data"))
        out = await self.server.generate(
            prompt_ids, self.response_length, self.engine_multi_modal_data(kwargs.get("multi_modal_data"), mm_inputs)
        )
        ids = list(out.token_ids)[: self.response_length]
        logprobs = list(out.log_probs)[: len(ids)] if out.log_probs is not None else None
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=logprobs,
            num_turns=2,
            metrics={},
            multi_modal_inputs=mm_inputs,
        )
