"""A long random fuzz run of a running proxy (the CI run, tests/integration/test_fuzz.py, is short and
derandomized). Same strategies and checks (tests/fuzzing.py): no 5xx other than the documented backend errors,
no hang, OpenAI error bodies, streams that end in ``[DONE]`` or an error event.

    steptap serve --backend http://127.0.0.1:8000 --port 8400 --control-token T --log /tmp/fuzz-log &
    python bench/fuzz_long.py --proxy http://127.0.0.1:8400 --token T --model tiny --examples 20000

The admin route is fuzzed without the control token only: never point this at a proxy whose weights matter.
Afterwards, stop the proxy and start it again on the same log: it must start, and
``GET /trajectories?follow=0`` must read every finished trajectory back. A failure prints the smallest
request hypothesis found that breaks a promise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fuzzing import Request, control_call, model_call, send  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402


def _post(url: str, token: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
        return json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", required=True, help="the proxy's base URL")
    p.add_argument("--token", required=True, help="its control token")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--examples", type=int, default=5000, help="per strategy (model calls, control calls)")
    p.add_argument("--sessions", type=int, default=8,
                   help="sessions opened first, whose ids and keys are reused")
    args = p.parse_args(argv)
    base = args.proxy.rstrip("/")
    infos = [_post(f"{base}/sessions", args.token, {"group_id": f"fz{i % 3}"}) for i in range(args.sessions)]
    statuses: Counter = Counter()
    run = settings(max_examples=args.examples, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))

    @run
    @given(model_call(args.model, [i["api_key"] for i in infos]))
    def fuzz_models(req: Request) -> None:
        statuses[send(base, req)[0]] += 1

    @run
    @given(control_call(args.token, [i["id"] for i in infos]))
    def fuzz_control(req: Request) -> None:
        statuses[send(base, req)[0]] += 1

    t0 = time.perf_counter()
    fuzz_models()
    fuzz_control()
    elapsed = time.perf_counter() - t0
    total = sum(statuses.values())
    print(f"{total} requests in {elapsed:.0f} s; statuses: " + ", ".join(f"{k}: {v}" for k,
                                                                         v in sorted(statuses.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
