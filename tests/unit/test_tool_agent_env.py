"""The tool recipe's parts (examples/tool_agent): the task generator, the rewards, the history the model sees,
and the held-out rates `steptap eval` reports. The run through the proxy is in
tests/integration/test_env_run.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from steptap.adapters.env.dataset import resolve_env
from steptap.adapters.env.runner import Episode, Tally
from steptap.adapters.env.tool_agent import (
    ARGUMENTS_REWARD,
    ATTEMPT_REWARD,
    CALL_REWARD,
    EVAL_SEED,
    NAMED_REWARD,
    OPENED_REWARD,
    ToolAgentEnv,
    make_rows,
    pairs,
)


def _call(expression: str) -> dict[str, Any]:  # as vLLM's hermes parser returns it
    args = json.dumps({"expression": expression})
    call = {"id": "c1", "function": {"name": "calculator", "arguments": args}}
    return {"content": "", "tool_calls": [call]}


def _episode(env: ToolAgentEnv, actions: list[dict[str, Any]]) -> list[tuple[Any, bool, dict[str, Any]]]:
    async def run() -> list[tuple[Any, bool, dict[str, Any]]]:
        out = []
        for action in actions:
            _, reward, done, info = await env.step(action)
            out.append((reward, done, info))
        return out

    return asyncio.run(run())


def test_rows_are_exact_3x2_products_and_training_never_holds_an_eval_question() -> None:
    test = make_rows(100, seed=EVAL_SEED)
    train = make_rows(3000, seed=0, held_out=100)
    for row in test + train:
        a, b = (int(x) for x in row["env_kwargs"]["expression"].split(" * "))
        assert 100 <= a <= 999 and 10 <= b <= 99
        assert row["reward_model"]["ground_truth"] == str(a * b)
        assert row["prompt"][0]["content"] == f"What is {a} * {b}?" and row["agent_name"] == "tool_agent"
    held = {r["env_kwargs"]["expression"] for r in test}
    assert len(held) == 100 and not held & {r["env_kwargs"]["expression"] for r in train}
    assert make_rows(5, seed=3) == make_rows(5, seed=3)  # reproducible
    assert len(set(pairs(500, 7))) == 500


def test_the_registered_env_starts_from_the_system_prompt_and_one_worked_example() -> None:
    env = resolve_env("tool_agent", allow_code=False)()
    row = make_rows(1, seed=1)[0]
    obs = env.reset(prompt=row["prompt"], reward_model=row["reward_model"])
    assert [m["role"] for m in obs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert "<tool_call>" in obs[2]["content"] and obs[-1] == row["prompt"][0]


def test_call_then_exact_answer_earns_the_process_reward_once_and_the_outcome() -> None:
    env = ToolAgentEnv()
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    steps = _episode(env, [_call("123 * 45"), _call("123 * 45"), {"content": "The answer is 5535."}])
    assert [s[0] for s in steps] == [CALL_REWARD, None, None]  # a second call earns nothing more
    assert steps[-1][1] and steps[-1][2]["correct"] and env.outcome() == 1.0
    assert steps[-1][2]["calls"] == 2 and steps[-1][2]["well_formed_calls"] == 2
    # the history holds each call as the text a hermes model writes, then the tool's result
    assert env.messages[6]["content"] == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 45"}}\n</tool_call>'
    )
    assert "tool_calls" not in env.messages[6] and json.loads(env.messages[7]["content"]) == {"result": 5535}


def test_a_malformed_call_earns_the_attempt_reward_and_a_wrong_answer_nothing() -> None:
    env = ToolAgentEnv()
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    steps = _episode(env, [{"content": '<tool_call>\n{"result": 5535}\n</tool_call>'}, _call("123 * 45"),
                           {"content": "The answer is 5536."}])
    assert steps[0][0] == ATTEMPT_REWARD
    assert steps[1][0] == CALL_REWARD - ATTEMPT_REWARD  # at most CALL_REWARD an episode
    assert json.loads(env.messages[7]["content"])["error"].startswith("unknown tool")
    assert env.outcome() == 0.0 and not steps[-1][2]["correct"]
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    steps = _episode(env, [{"content": "The answer is 5535."}])  # right without the tool: still right
    assert steps == [(None, True, steps[0][2])] and env.outcome() == 1.0 and steps[0][2]["calls"] == 0


def test_a_tool_call_opened_and_never_closed_earns_the_smallest_grade_and_ends_the_episode() -> None:
    env = ToolAgentEnv()
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    (step,) = _episode(env, [{"content": '<tool_call>\n{"result": 5535}'}])
    assert step[0] == OPENED_REWARD and step[1] and step[2]["calls"] == 0 and env.outcome() == 1.0


def test_a_call_whose_tool_reports_an_error_is_not_well_formed() -> None:
    env = ToolAgentEnv()
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    (step,) = _episode(env, [_call("123 ** ")])
    assert step[0] == ARGUMENTS_REWARD and step[2]["calls"] == 1 and step[2]["well_formed_calls"] == 0


def test_each_part_of_the_call_format_earns_its_own_grade_up_to_a_call_that_ran() -> None:
    """The rerun that stayed at 0 (issue 40) closed blocks shaped like the tool's result and was paid the same
    for them whatever they held: each step towards {"name": "calculator", "arguments": {"expression": ...}}
    now earns more than the one before, and an episode is paid its best grade once."""
    def first_grade(text: str) -> Any:
        env = ToolAgentEnv()
        env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
        return _episode(env, [{"content": text}])[0][0]

    block = "<tool_call>\n{}\n</tool_call>".format
    ladder = [
        ("The answer is 5000.", None),
        ('<tool_call>\n{"result": 123 * 45}', OPENED_REWARD),
        (block('{"result": 5535}'), ATTEMPT_REWARD),
        (block('{"name": "calculator", "arguments": {"numbers": [123, 45]}}'), NAMED_REWARD),
        (block('{"name": "calculator", "arguments": {"expression": "123 x 45"}}'), ARGUMENTS_REWARD),
        (block('{"name": "calculator", "arguments": {"expression": "123 * 45"}}'), CALL_REWARD),
    ]
    assert [first_grade(text) for text, _ in ladder] == [grade for _, grade in ladder]
    assert OPENED_REWARD < ATTEMPT_REWARD < NAMED_REWARD < ARGUMENTS_REWARD < CALL_REWARD
    env = ToolAgentEnv()
    env.reset(prompt="What is 123 * 45?", reward_model={"ground_truth": "5535"})
    steps = _episode(env, [{"content": block('{"name": "calculator", "arguments": {}}')}, _call("123 * 45"),
                           _call("123 * 45")])
    assert [s[0] for s in steps] == [NAMED_REWARD, CALL_REWARD - NAMED_REWARD, None]  # the best grade, once


def test_eval_rates_by_version_count_episodes_with_a_call_and_with_a_well_formed_one() -> None:
    tally = Tally()
    infos = [({"calls": 1, "well_formed_calls": 1, "turns": 2}, True), ({"calls": 2, "well_formed_calls": 0,
             "turns": 3}, False), ({"calls": 0, "well_formed_calls": 0, "turns": 1}, False),
             ({"calls": 0, "well_formed_calls": 0, "turns": 1}, True)]
    for i, (info, correct) in enumerate(infos):
        tally.add(Episode(epoch=0, row=i, member=0, group_id="g", status="finished", reward=float(correct),
                          correct=correct, steps=info["turns"], policy_version=3, info=info))
    v = tally.by_version()[3]
    figures = (v["accuracy"], v["tool_call_rate"], v["well_formed_rate"], v["turns_mean"])
    assert figures == (0.5, 0.5, 0.25, 1.75)
    plain = Tally()  # an environment that counts no calls: no rates
    plain.add(Episode(epoch=0, row=0, member=0, group_id="g", status="finished", reward=1.0, correct=True,
                      steps=1, policy_version=0, info={"turns": 1}))
    assert plain.by_version()[0]["tool_call_rate"] is None and plain.by_version()[0]["turns_mean"] == 1
