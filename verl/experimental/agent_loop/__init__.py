"""Multi-turn rollouts: agent loops (single turn, tool calling) and tool-call parsers."""

from .agent_loop import (
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopOutput,
    TurnBatcher,
    compute_position_ids,
    get_agent_loop_class,
    register,
    rope_indexer_from_config,
)
from .single_turn_agent_loop import SingleTurnAgentLoop
from .tool_agent_loop import ToolAgentLoop
from .tool_parser import FunctionCall, ToolParser

__all__ = [
    "AgentLoopBase",
    "AgentLoopManager",
    "AgentLoopOutput",
    "TurnBatcher",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "FunctionCall",
    "ToolParser",
    "compute_position_ids",
    "get_agent_loop_class",
    "register",
    "rope_indexer_from_config",
]
