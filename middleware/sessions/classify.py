"""Side calls and branches: which line of a session a model call belongs to, decided without touching the
client.

Agent CLIs interleave calls that are not the agent's main line: title generation, small-fast-model calls,
summaries, compaction that rewrites the history. Each step gets a class and the rule that decided it:

- ``side`` by ``side_model``: its model is one of the session's side aliases (``ProxyConfig.side_models`` or
  the session's own ``side_models``), e.g. Claude Code's small-fast model name;
- ``main`` by ``first``: the session's first call (not a side alias);
- ``main`` by ``extends`` / ``rerendered``: it continues the main line (its prompt extends the main line's
  last call token for token, or the same conversation came back rendered otherwise);
- ``branch`` by ``rewrites_history``: it starts as the main line does (the same first message: the system
  prompt) but the history was rewritten from its start (the message after the system prompt is another: a
  compaction's summary in place of the task and the turns): a new branch of the same trajectory
  (``Step.branch`` counts them), whose later calls are ``main`` again;
- ``main`` by ``edited``: the same first two messages, the history edited later on (OpenClaw moves its
  internal-context message to the end of every request): still the main line, though not one token sequence
  (``Step.prefix`` says why);
- ``side`` by ``other``: anything else (another system prompt: a title or summary call beside the main line).

The main line's continuity is judged against its own last call, never a side call's, so a side call between
two turns leaves the main line one token sequence. Pure; ``SessionManager.record`` applies it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from steptap.middleware.records import CallClass, PrefixCause, Step
from steptap.middleware.sessions.prefix import first_messages


@dataclass
class MainLine:
    """What a session knows of its main line: the messages its first main call opened with, its branch."""

    start: list[Any] = field(default_factory=list)  # the first two messages (normalized) of its branch
    branch: int = 0
    started: bool = False
    side_models: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Decision:
    call_class: CallClass
    rule: str
    branch: int


def decide(line: MainLine, step: Step, prefix: PrefixCause, side_models: Collection[str] = (),
           chat: list[Any] | None = None) -> Decision:
    """The class of ``step`` given the main line and ``prefix`` (its continuity against the main line's last
    call, ``prefix.classify_after``); ``chat``: its request's messages in chat form when translated. Does not
    change ``line``: ``advance`` does, once per call."""
    if step.model in side_models or step.model in line.side_models:
        return Decision("side", "side_model", line.branch)
    if not line.started:
        return Decision("main", "first", line.branch)
    if prefix in ("extends", "rerendered"):
        return Decision("main", prefix, line.branch)
    opening = first_messages(step, chat)
    if line.start and opening[:1] == line.start[:1]:  # the same system prompt
        if opening[1:] != line.start[1:]:  # what followed it was replaced: a compaction
            return Decision("branch", "rewrites_history", line.branch + 1)
        return Decision("main", "edited", line.branch)
    return Decision("side", "other", line.branch)


def advance(line: MainLine, decision: Decision, step: Step, chat: list[Any] | None = None) -> None:
    """Move the main line on after a call of ``decision``'s class (side calls leave it as it was)."""
    if decision.call_class == "side":
        return
    if not line.started or decision.call_class == "branch":  # a branch's own opening: its summary
        line.started, line.start = True, first_messages(step, chat)
    line.branch = decision.branch


def apply(line: MainLine, steps: list[Step], prefixes: list[PrefixCause], side_models: Collection[str] = (),
          chat: list[Any] | None = None) -> bool:
    """Classify the steps of one call (the choices of one call share a class) and move the line on; returns
    whether the call is on the main line (so the session judges the next call against it)."""
    if not steps:
        return False
    decision = decide(line, steps[0], prefixes[0], side_models, chat)
    for step in steps:
        step.call_class, step.call_rule, step.branch = decision.call_class, decision.rule, decision.branch
    if any(s.status == "ok" for s in steps):  # a failed call carries no ids: the line stays where it was
        advance(line, decision, steps[0], chat)
    return decision.call_class != "side"
