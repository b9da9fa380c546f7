"""(tests/scripted_tools/) A tool-call script: which reply the model gives to which last turn (torch-free).

A script is a JSON file ``{"rules": [{"when": REGEX, "reply": TEXT}, ...]}``. For a prompt rendered with a
ChatML template, the *last turn* is the text of the turns after the last assistant turn, system turns left out
(the user's task on the first call, the ``<tool_response>`` turn after a tool ran). The first rule whose regex
``search``es it gives the reply (with ``\\1`` / ``\\g<name>`` filled from the match, as ``re.Match.expand``),
forced token by token by ``tool_logits.ScriptedReplies`` inside vLLM; no rule matching leaves the model alone.
The test gives the CLI a task holding the trigger; the CLI sends nothing special.

``DEFAULT_RULES``: a judge's prompt holding ``STEPTAP_JUDGE_SCORE=X`` answers ``SCORE: X`` (its last marker);
a task holding ``STEPTAP_CALL {"name": ..., "arguments": {...}}`` (one line of JSON, the
tool's name and arguments as the CLI under test defines them) gets that hermes tool call; a tool response gets
the answer ``The tool ran. Its output: <its first line>`` and the turn ends (a chain's and a read-back's
markers excepted, below); a tool response holding a
``steptap-ran-...`` word anywhere answers with that word instead (the CLIs wrap a command's output
differently; a test echoes ``steptap-ran-$((6*7))`` so the answer holds ``steptap-ran-42`` only if the command
ran).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SCRIPT_ENV = "STEPTAP_TOOL_SCRIPT"  # the script file the processor in vLLM's process reads at start
MAX_RULES = 64
MAX_REPLY_CHARS = 4096  # a filled-in reply is cut here: the processor never fails a request

# a chain's output (below): steptap-next.AGENT.TOOL.ARG.READ_TOOL.READ_ARG.N
_NEXT = r"<tool_response>[\s\S]*?steptap-next\.([\w-]+)\.(\w+)\.(\w+)\.(\w+)\.(\w+)\."
_EPISODE = r"<tool_response>[\s\S]*?steptap-episode\.([\w-]+)\.(\w+)\.(\w+)\."  # a task episode's first call
_CALL = '<tool_call>\n{"name": "\\2", "arguments": {"\\3": '
_ANSWER = r'"echo N > /app/answer.txt; echo steptap-ran-\1-$((6*7))"}}' + "\n</tool_call>"
DEFAULT_RULES = [
    # A judge's prompt (steptap.adapters.judge) whose conversation holds `STEPTAP_JUDGE_SCORE=X` answers
    # `SCORE: X` for the last such marker (the greedy start): a test chooses each score the judge gives
    (r"[\s\S]*STEPTAP_JUDGE_SCORE=(\w+)[\s\S]*Answer with one line: SCORE", r"SCORE: \1"),
    # Claude Code's title call (the user's message in <session> tags) asks for JSON with a schema, a grammar
    # in vLLM: its title as that JSON (a forced tool call, which its task's trigger would give, breaks it)
    (r"<session>[\s\S]*</session>", '{"title": "Scripted session title"}'),
    # a CLI that wraps the output (Codex's header lines, OpenClaw's JSON) still shows the marker (ending in a
    # digit, so a command line echoed back, `steptap-ran-$((6*7))`, never matches)
    (r"<tool_response>[\s\S]*?(steptap-ran-[\w-]{0,40}\d)\b", r"The tool ran. Its output: \1"),
    # A read-back: a command's output `steptap-read.TOOL.ARG.PATH` asks for the CLI's own file tool TOOL on
    # PATH (its argument ARG); what the file holds (a chain's next step, below, or the marker above) moves the
    # session on only if the tool read it. Codex has no file-read tool of its own: it reads with `cat` through
    # its shell tool
    (r"<tool_response>[\s\S]*?steptap-read\.exec_command\.(\w+)\.(/[\w./-]+)",
     '<tool_call>\n{"name": "exec_command", "arguments": {"\\1": "cat \\2"}}\n</tool_call>'),
    (r"<tool_response>[\s\S]*?steptap-read\.(\w+)\.(\w+)\.([\w./-]*\w)",
     '<tool_call>\n{"name": "\\1", "arguments": {"\\2": "\\3"}}\n</tool_call>'),
    # A chain of calls (a session of many turns): an output `steptap-next.AGENT.TOOL.ARG.READ.RARG.N DIR` asks
    # for the next call of the shell tool TOOL, which prints N - 1 (by the shell's arithmetic: only a command
    # that ran moves the chain on) and DIR; at 0, the call that writes the `steptap-ran-AGENT-42` marker to a
    # file in DIR with a redirect (a command each CLI sandboxes) and prints where it is for the file tool READ
    # (argument RARG). No variable or expansion in it (`$PWD`, `$((6*7))`): Claude Code's permission check
    # refuses them beside a redirect (the 42 comes from printf's %d: only a command that ran writes it)
    (_NEXT + r"([1-9]) (/[\w./-]+)",
     _CALL + r'"echo steptap-next.\1.\2.\3.\4.\5.$((\6-1)) \7"}}' + "\n</tool_call>"),
    (_NEXT + r"0 (/[\w./-]+)", _CALL + r'"printf steptap-ran-\1-%d 42 > \6/steptap-\1.txt && '
     r'echo steptap-read.\4.\5.\6/steptap-\1.txt"}}' + "\n</tool_call>"),
    # Codex's goal tool mid-session: an output `steptap-goal.WORD` asks for `create_goal` (its objective:
    # reach WORD); Codex then sends the objective back as a tool output with no call (docs/protocols.md)
    (r"<tool_response>[\s\S]*?steptap-goal\.(\w+)",
     '<tool_call>\n{"name": "create_goal", "arguments": {"objective": "Reach \\1."}}\n</tool_call>'),
    # A task episode (tests/integration/test_tasks_agents.py): its first call prints
    # `steptap-episode.AGENT.TOOL.ARG.K`, K the digits of the sandbox's hostname (episode-K: only a command
    # that ran prints it); even episodes then write the task's answer, odd ones a wrong one
    (_EPISODE + r"(\d*[02468])\b", _CALL + _ANSWER.replace("N", "42")),
    (_EPISODE + r"(\d*[13579])\b", _CALL + _ANSWER.replace("N", "41")),
    (r"<tool_response>\n\s*([^\n]{0,200})", r"The tool ran. Its output: \1"),
    # a reply with a special token mid-text (the end-of-text token, not the end of the turn): what a client
    # is shown of it (tests/integration/test_special_tokens.py)
    (r"STEPTAP_SPECIAL", "Before<|endoftext|>after"),
    # Codex's turn after a compaction holds the task again (its trigger too) with the summary: answered, so
    # the turn ends rather than calling the tool and compacting again
    (r"produced a summary of its thinking process", "The summary was read."),
    (r"STEPTAP_CALL (\{[^\n]*\})", "<tool_call>\n\\1\n</tool_call>"),
]


@dataclass(frozen=True)
class Rule:
    when: re.Pattern[str]
    reply: str


def parse_script(data: object) -> list[Rule]:
    """The rules of a script, checked: a bad script fails the server's start, not a request."""
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError('a tool script is {"rules": [{"when": REGEX, "reply": TEXT}, ...]}')
    rules = data["rules"]
    if not 0 < len(rules) <= MAX_RULES:
        raise ValueError(f"a tool script has 1 to {MAX_RULES} rules, got {len(rules)}")
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or set(rule) != {"when", "reply"}:
            raise ValueError(f"rule {i}: exactly the keys 'when' and 'reply'")
        when, reply = rule["when"], rule["reply"]
        if not isinstance(when, str) or not isinstance(reply, str) or not reply:
            raise ValueError(f"rule {i}: 'when' is a regex and 'reply' a non-empty string")
        if len(reply) > MAX_REPLY_CHARS:
            raise ValueError(f"rule {i}: reply longer than {MAX_REPLY_CHARS} characters")
        out.append(Rule(re.compile(when), reply))
    return out


def load_script(path: str | Path) -> list[Rule]:
    return parse_script(json.loads(Path(path).read_text()))


def write_script(path: str | Path, rules: Sequence[tuple[str, str]]) -> Path:
    """Write ``[(when_regex, reply), ...]`` as a script file (checked by parsing it back)."""
    data = {"rules": [{"when": w, "reply": r} for w, r in rules]}
    parse_script(data)
    path = Path(path)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def hermes_call(name: str, arguments: dict) -> str:
    """A reply that is one tool call in the hermes format vLLM's hermes parser reads."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def last_turn(prompt_ids: Sequence[int], im_start: int, decode: Callable[[Sequence[int]], str]) -> str | None:
    """The text of the turns after the last assistant turn, system turns left out, or None for a prompt
    that is not ChatML. Each turn is decoded on its own (``role\\ncontent``): a 50k-token prompt costs the
    decoding of its last few turns, not all of it."""
    starts = [i for i, t in enumerate(prompt_ids) if t == im_start]
    if len(starts) < 2:
        return None
    # The last start opens the reply being generated (the generation prompt): the turns before it count.
    bounds = list(zip(starts[:-1], starts[1:], strict=False))
    texts: list[str] = []
    for begin, end in reversed(bounds):
        text = decode(prompt_ids[begin + 1 : end]).removesuffix("\n")  # the newline after <|im_end|>
        role = text.split("\n", 1)[0].strip()
        if role == "assistant":
            break
        if role != "system":
            texts.append(text)
    return "\n".join(reversed(texts))


def choose(rules: Sequence[Rule], turn: str | None) -> str | None:
    """The reply of the first rule matching the last turn, filled from the match, else None (the model
    samples freely)."""
    if turn is None:
        return None
    for rule in rules:
        if match := rule.when.search(turn):
            return match.expand(rule.reply)[:MAX_REPLY_CHARS] or None
    return None


def server_options(script: str | Path) -> dict:
    """``VLLMServer`` keyword arguments that load the processor with ``script``: merge ``extra_args`` and
    ``env`` with any others the server needs. vLLM finds the processor through ``PYTHONPATH``: this folder
    alone, so no other test module can shadow a package of vLLM's."""
    return {
        "extra_args": ["--logits-processors", "tool_logits:ScriptedReplies"],
        "env": {"PYTHONPATH": str(Path(__file__).parent.resolve()), SCRIPT_ENV: str(Path(script).resolve())},
    }
