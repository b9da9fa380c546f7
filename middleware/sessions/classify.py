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
  compaction's summary in place of the task and the turns), or none of the agent's turns of the main line's
  last call is left in it (Codex keeps its opening messages and the task and puts the summary in place of the
  turns): a new branch of the same trajectory (``Step.branch`` counts them), whose later calls are ``main``
  again;
- ``main`` by ``edited``: the same first two messages, the history edited later on (OpenClaw moves its
  internal-context message to the end of every request), or the message after the system prompt continued
  (Claude Code appends "[Your previous response had no visible output ...]" to the task to retry an empty
  reply): still the main line, though not one token sequence (``Step.prefix`` says why);
- ``main`` by ``supersedes``: the main line so far is one call that offered no tools (a title call sent
  first: opencode's, "You are a title generator ..."), and this call offers tools and would otherwise be a
  side call (another system prompt): an agent loop cannot start with that tool-less call, so the main line
  starts here, and that call (its choices) turns ``side`` by ``superseded`` (``SessionManager.record``
  marks it; the finished trajectory's ``StepRef`` carries the new class, the logged step keeps the one it
  was logged with). So which of the two arrives first decides nothing, with no configuration;
- ``side`` by ``other``: anything else (another system prompt: a title or summary call beside the main line).

The main line's continuity is judged against its own last call, never a side call's, so a side call between
two turns leaves the main line one token sequence. System prompts are compared as the model sees them: Claude
Code's ``x-anthropic-billing-header`` line, which changes with the conversation, is left out as vLLM leaves it
out of the prompt. Pure; ``SessionManager.record`` applies it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec

from steptap.middleware.records import CallClass, PrefixCause, Step
from steptap.middleware.sessions.prefix import Norms, first_messages, messages_of


@dataclass
class MainLine:
    """What a session knows of its main line: the messages its first main call opened with, its branch."""

    start: list[Any] = field(default_factory=list)  # the first two messages (normalized) of its branch
    branch: int = 0
    started: bool = False
    # the main line is its first call alone, which offered no tools: a call with tools may take its place
    provisional: bool = False
    side_models: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Decision:
    call_class: CallClass
    rule: str
    branch: int


def decide(line: MainLine, step: Step, prefix: PrefixCause, side_models: Collection[str] = (),
           chat: list[Any] | None = None, last: Last = None, norms: Norms | None = None) -> Decision:
    """The class of ``step`` given the main line and ``prefix`` (its continuity against the main line's last
    call, ``prefix.classify_after``); ``chat``: its request's messages in chat form when translated; ``last``:
    the main line's last call and its messages in chat form (None when translated and not at hand). Does not
    change ``line``: ``advance`` does, once per call."""
    if step.model in side_models or step.model in line.side_models:
        return Decision("side", "side_model", line.branch)
    if not line.started:
        return Decision("main", "first", line.branch)
    if prefix in ("extends", "rerendered"):
        return Decision("main", prefix, line.branch)
    opening = _opening(step, chat)
    if line.start and opening[:1] == line.start[:1]:  # the same system prompt
        # a compaction: the task replaced, or every turn of the agent gone
        if not _continues(line.start[1:], opening[1:]) or _turns_gone(last, step, chat, norms):
            return Decision("branch", "rewrites_history", line.branch + 1)
        return Decision("main", "edited", line.branch)
    if line.provisional and offers_tools(step):  # an agent loop does not start with a tool-less call
        return Decision("main", SUPERSEDES, line.branch)
    return Decision("side", "other", line.branch)


SUPERSEDES, SUPERSEDED = "supersedes", "superseded"


def offers_tools(step: Step) -> bool:
    """Whether the call offered the model tools (chat, Responses and Messages all name them ``tools``)."""
    return bool(step.request.get("tools"))


BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's attribution line (vllm/renderers/chat_utils.py)


def _without_billing(message: Any) -> Any:
    """A system message as the model sees it: vLLM drops a text part's first line when it is Claude Code's
    billing header (its value changes with the conversation, e.g. after a compaction)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if isinstance(text, str) and text.startswith(BILLING_HEADER):
            rest = text.partition("\n")[2]
            if rest:
                parts.append({**part, "text": rest})
            continue
        parts.append(part)
    return {**message, "content": parts}


def _opening(step: Step, chat: list[Any] | None) -> list[Any]:
    """The first two messages, normalized, the system prompt as the model sees it."""
    messages = chat if chat is not None else (
        step.request.get("messages") if step.endpoint == "chat.completions" else None)
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            and messages[0].get("role") == "system":
        chat = [_without_billing(messages[0]), *messages[1:2]]
    return first_messages(step, chat)


Last = tuple[Step, list[Any] | None] | None


def _turns_gone(last: Last, step: Step, chat: list[Any] | None, norms: Norms | None = None) -> bool:
    """Whether the main line's last call held turns of the agent (assistant messages) and none of them, nor
    that call's reply, is left in ``step``'s conversation: its history after the opening replaced, not edited
    (a retry or a sliding window keeps some)."""
    if last is None:
        return False
    prev, prev_chat = last
    # empty for /v1/completions, or a translated call whose messages are not at hand (after a restart)
    turns = [m for m in messages_of(prev, prev_chat, norms) if m[0] == "assistant"]
    if not turns:
        return False
    new = messages_of(step, chat, norms)
    return not any(t in new for t in (*turns, *first_messages(prev, [prev.response], 1)))


def _continues(before: list[Any], after: list[Any]) -> bool:
    """Whether the message after the system prompt is the main line's, or it continued (its text extended: a
    retry that appends to the task), rather than replaced by another (a compaction's summary)."""
    if before == after:
        return True
    if len(before) != 1 or len(after) != 1:
        return False
    (role, content, calls, name), (role2, content2, calls2, name2) = before[0], after[0]
    return (role, calls, name) == (role2, calls2, name2) and _text_continues(content, content2)


def _text_continues(old: Any, new: Any) -> bool:
    # normalized text content is a str; anything else (parts with images) is compared whole
    return isinstance(old, str) and isinstance(new, str) and len(new) > len(old) and new.startswith(old)


def advance(line: MainLine, decision: Decision, step: Step, chat: list[Any] | None = None) -> None:
    """Move the main line on after a call of ``decision``'s class (side calls leave it as it was)."""
    if decision.call_class == "side":
        return
    restart = not line.started or decision.rule == SUPERSEDES
    if restart or decision.call_class == "branch":  # a branch's own opening: its summary
        line.started, line.start = True, _opening(step, chat)
    line.provisional = restart and not offers_tools(step)
    line.branch = decision.branch


def apply(line: MainLine, steps: list[Step], prefixes: list[PrefixCause], side_models: Collection[str] = (),
          chat: list[Any] | None = None, last: Last = None, norms: Norms | None = None) -> bool:
    """Classify the steps of one call (the choices of one call share a class) and move the line on; returns
    whether the call is on the main line (so the session judges the next call against it). A call that
    ``supersedes`` the main line's tool-less first call: the caller turns that call's steps ``side``
    (``supersede``)."""
    if not steps:
        return False
    decision = decide(line, steps[0], prefixes[0], side_models, chat, last, norms)
    for step in steps:
        step.call_class, step.call_rule, step.branch = decision.call_class, decision.rule, decision.branch
        if decision.rule == SUPERSEDES:  # the main line starts here: judged against nothing before it
            step.prefix = "first"
    if any(s.status == "ok" for s in steps):  # a failed call carries no ids: the line stays where it was
        advance(line, decision, steps[0], chat)
    return decision.call_class != "side"


def supersede(steps: list[Step], before: int) -> None:
    """After a call that ``supersedes`` the main line: the steps before index ``before`` that were on the main
    line (its tool-less first call, its choices) turned ``side`` by ``superseded``, in place (new objects: the
    logged ones are not touched)."""
    for i, step in enumerate(steps):
        if step.index < before and step.call_class != "side":
            steps[i] = msgspec.structs.replace(step, call_class="side", call_rule=SUPERSEDED)
