"""The tool-call script (tests/tool_script.py): parsing, the last turn of a ChatML prompt, rule choice.

Checked on the real tiny model's tokenizer and chat template, as the logits processor sees prompts in vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_tools.tool_script import (
    DEFAULT_RULES,
    SCRIPT_ENV,
    choose,
    hermes_call,
    last_turn,
    load_script,
    parse_script,
    server_options,
    write_script,
)

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _turn(tokenizer, messages: list[dict]) -> str | None:  # type: ignore[no-untyped-def]
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    return last_turn(ids, im_start, lambda t: tokenizer.decode(t, skip_special_tokens=True))


def test_last_turn_is_the_task_first_and_the_tool_result_after(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = [{"role": "system", "content": "You are an agent. RUN-IT is not a task here."},
            {"role": "user", "content": "Do the thing. RUN-IT"}]
    assert _turn(tokenizer, task) == "user\nDo the thing. RUN-IT"
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    after = task + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    # The task is before the assistant turn: only the tool response counts now.
    assert _turn(tokenizer, after) == "user\n<tool_response>\na.txt\n</tool_response>"


def test_not_chatml_has_no_last_turn() -> None:
    assert last_turn([5, 6, 7], im_start=1, decode=lambda ids: "x") is None
    assert last_turn([1, 5, 6], im_start=1, decode=lambda ids: "x") is None  # only the generation prompt


def test_first_matching_rule_wins_and_no_match_is_none(tmp_path: Path) -> None:
    path = write_script(tmp_path / "s.json", [(r"<tool_response>", "Done."), (r"RUN-IT", hermes_call("bash", {
        "command": "echo hi"}))])
    rules = load_script(path)
    assert choose(rules, "user\nplease RUN-IT") == '<tool_call>\n{"name": "bash", "arguments": {"command": ' \
        '"echo hi"}}\n</tool_call>'
    assert choose(rules, "user\n<tool_response>\nRUN-IT\n</tool_response>") == "Done."
    assert choose(rules, "user\nhello") is None
    assert choose(rules, None) is None


def test_default_rules_call_the_tool_the_task_names_then_answer_with_its_output(tmp_path: Path) -> None:
    rules = load_script(write_script(tmp_path / "s.json", DEFAULT_RULES))
    call = {"name": "exec", "arguments": {"command": "echo \"a b\""}}
    task = f"user\nRun this, then say what it printed. STEPTAP_CALL {json.dumps(call)}\nThanks."
    assert choose(rules, task) == hermes_call("exec", call["arguments"])
    answer = choose(rules, "user\n<tool_response>\n\na b\nsecond line\n</tool_response>")
    assert answer == "The tool ran. Its output: a b"
    assert choose(rules, "user\nNo trigger here.") is None
    # Claude Code's title call holds the task (and its trigger) in <session> tags: a title, as its JSON
    title = json.loads(choose(rules, f"user\n<session>{task}</session>") or "")
    assert title == {"title": "Scripted session title"}


def test_default_rules_chain_calls_by_their_output_until_the_marker(tmp_path: Path) -> None:
    """A chain (a session of many turns): each output names the next call; the command line echoed back
    (`$((2-1))`, not yet a number) never moves it on; after 0 hops the shell writes the marker to a file and
    prints where, and that output asks for the CLI's own file tool on it (Codex's: `cat` in its shell)."""
    rules = load_script(write_script(tmp_path / "s.json", DEFAULT_RULES))
    chain = "steptap-next.claude-code.Bash.command.Read.file_path"
    echoed = f"user\n<tool_response>\nCommand: echo {chain}.$((2-1)) /w\n"
    ran = f"The tool ran. Its output: Command: echo {chain}.$((2-1)) /w"
    assert choose(rules, echoed + "</tool_response>") == ran
    assert choose(rules, echoed + f"{chain}.1 /w\n</tool_response>") == hermes_call(
        "Bash", {"command": f"echo {chain}.$((1-1)) /w"})
    wrapped = f'user\n<tool_response>\n{{"out": "{chain}.0 /w"}}\n</tool_response>'
    write = "printf steptap-ran-claude-code-%d 42 > /w/steptap-claude-code.txt && " \
        "echo steptap-read.Read.file_path./w/steptap-claude-code.txt"
    assert choose(rules, wrapped) == hermes_call("Bash", {"command": write})
    wrote = f"user\n<tool_response>\nCommand: {write}\n" \
        "steptap-read.Read.file_path./w/steptap-claude-code.txt\n"
    assert choose(rules, wrote + "</tool_response>") == hermes_call(
        "Read", {"file_path": "/w/steptap-claude-code.txt"})
    codex = "user\n<tool_response>\nOutput:\nsteptap-read.exec_command.cmd./w/steptap-codex.txt\n" \
        "</tool_response>"
    assert choose(rules, codex) == hermes_call("exec_command", {"cmd": "cat /w/steptap-codex.txt"})
    assert choose(rules, "user\n<tool_response>\n     1\tsteptap-ran-codex-42\n</tool_response>") == \
        "The tool ran. Its output: steptap-ran-codex-42"


def test_default_rules_answer_right_in_even_episodes_and_wrong_in_odd_ones(tmp_path: Path) -> None:
    """A task episode's first output names its index (the sandbox's hostname digits): a group of 2 gets one
    right answer and one wrong (tests/integration/test_tasks_agents.py, test_pi_learns.py)."""
    rules = load_script(write_script(tmp_path / "s.json", DEFAULT_RULES))

    def written(k: int) -> str:
        reply = choose(rules, f"user\n<tool_response>\nsteptap-episode.pi.bash.command.{k}\n</tool_response>")
        return json.loads(reply.split("\n")[1])["arguments"]["command"].split(" >")[0]  # type: ignore[union-attr]

    assert [written(k) for k in (0, 1, 2, 3, 10, 11)] == ["echo 42", "echo 41"] * 3


def test_a_filled_in_reply_is_bounded(tmp_path: Path) -> None:
    rules = load_script(write_script(tmp_path / "s.json", [(r"ECHO (.*)", r"\1\1")]))
    assert len(choose(rules, "ECHO " + "x" * 3000) or "") == 4096


def test_server_options_load_the_processor_from_this_folder(tmp_path: Path) -> None:
    options = server_options(tmp_path / "s.json")
    assert options["extra_args"] == ["--logits-processors", "tool_logits:ScriptedReplies"]
    assert (Path(options["env"]["PYTHONPATH"]) / "tool_logits.py").is_file()
    assert options["env"][SCRIPT_ENV] == str((tmp_path / "s.json").resolve())


@pytest.mark.parametrize("data, message", [
    ([], "a tool script is"),
    ({"rules": []}, "1 to 64 rules"),
    ({"rules": [{"when": "x"}]}, "exactly the keys"),
    ({"rules": [{"when": "x", "reply": ""}]}, "non-empty string"),
    ({"rules": [{"when": "x", "reply": "y" * 5000}]}, "longer than"),
    ({"rules": [{"when": "(", "reply": "y"}]}, "missing \\)"),
])
def test_bad_scripts_are_refused_with_the_reason(data: object, message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match=message):
        load_script(path)
    with pytest.raises(Exception, match=message):
        parse_script(data)
