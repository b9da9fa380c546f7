"""steptap.adapters.env: Agent-R1's environment layer on the steptap proxy.

``BaseTool`` (an executable tool), ``AgentEnv`` (reset/step), ``ToolEnv`` (an environment built from tools),
``AgentEnvLoop`` (drives a model through the proxy until done), ``AgentFlowBase`` (full control), datasets of
parquet rows run as GRPO groups (``steptap env run``) and evaluation by policy version (``steptap eval``).
Depends on the middleware's client and records only."""

from __future__ import annotations

from steptap.adapters.env.base import AgentEnv, BaseTool, ToolEnv, parse_number, parse_tool_calls
from steptap.adapters.env.dataset import GROUP, DatasetError, Row, read_rows, resolve_env, write_rows
from steptap.adapters.env.loop import AgentEnvLoop, AgentFlowBase, FlowContext, ModelCallError
from steptap.adapters.env.runner import DatasetRunner, Episode, RunConfig, accuracy_by_version

__all__ = [
    "GROUP",
    "AgentEnv",
    "AgentEnvLoop",
    "AgentFlowBase",
    "BaseTool",
    "DatasetError",
    "DatasetRunner",
    "Episode",
    "FlowContext",
    "ModelCallError",
    "Row",
    "RunConfig",
    "ToolEnv",
    "accuracy_by_version",
    "parse_number",
    "parse_tool_calls",
    "read_rows",
    "resolve_env",
    "write_rows",
]
