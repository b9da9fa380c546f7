"""Re-record the benchmark's vLLM replies from a real server.

    python bench/record_fixtures.py --backend http://127.0.0.1:8000 [--name chat_32_tokens]
    python bench/record_fixtures.py --backend http://127.0.0.1:8000 --name chat_1400_tokens --max-tokens 1400

Sends one chat call for exactly ``--max-tokens`` generated tokens (32 by default, ``ignore_eos``) with
logprobs and ``return_token_ids`` on, once plain and once streamed, and writes both bodies byte for byte, with
the request that produced them and the server's ``/v1/models`` body, to ``bench/fixtures/NAME.json`` (gzipped
to ``NAME.json.gz`` when larger than 256 kB: a long reply's logprobs make it megabytes). Greedy, so the two
bodies carry the same tokens (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recorded import DEFAULT_FIXTURE, FIXTURES, sse_data

MAX_TOKENS = 32
GZIP_ABOVE = 256 * 1024  # bytes: a fixture this large is committed gzipped

# An agent-shaped prompt: a system prompt with instructions and a user turn with some context (a few hundred
# tokens), so the recorded prompt_token_ids are of a realistic size for one agent step.
SYSTEM = (
    "You are a careful software agent working in a terminal. You can read files, run commands and edit code. "
    "Think step by step, keep answers short, and never invent file contents you have not seen. When you are "
    "done, say DONE on its own line. Rules: 1. Prefer small, verifiable steps. 2. Run the tests after each "
    "change. 3. If a command fails, read the error before trying again. 4. Do not delete files you did not "
    "create. 5. Report what you changed and why."
)
USER = (
    "The test suite fails with `KeyError: 'token_ids'` in capture.py line 88 when the backend streams a "
    "reply whose last chunk carries only usage. Here is the traceback:\n\n"
    "Traceback (most recent call last):\n"
    '  File "middleware/capture.py", line 88, in feed\n'
    "    ids.extend(choice['token_ids'])\n"
    "KeyError: 'token_ids'\n\n"
    "And here is the chunk that triggers it:\n"
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[],'
    '"usage":{"prompt_tokens":120,"total_tokens":152,"completion_tokens":32}}\n\n'
    "Find the cause and propose a minimal fix."
)


def vllm_request(model: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def agent_request(model: str, max_tokens: int = MAX_TOKENS) -> dict:
    """What the benchmark's agent sends: the same call with neither logprobs nor token ids asked for."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


async def record(backend: str, name: str, max_tokens: int = MAX_TOKENS) -> Path:
    backend = backend.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        async with http.get(f"{backend}/v1/models") as r:
            r.raise_for_status()
            models = await r.read()
        model = json.loads(models)["data"][0]["id"]
        async with http.post(f"{backend}/v1/chat/completions",
                             json=vllm_request(model, False, max_tokens)) as r:
            r.raise_for_status()
            reply = await r.read()
        async with http.post(f"{backend}/v1/chat/completions",
                             json=vllm_request(model, True, max_tokens)) as r:
            r.raise_for_status()
            stream = await r.read()
        version = None
        async with http.get(f"{backend}/version") as r:
            if r.status == 200:
                version = (await r.json()).get("version")

    plain = json.loads(reply)
    ids = plain["choices"][0]["token_ids"]
    if len(ids) != max_tokens or len(plain["choices"][0]["logprobs"]["content"]) != max_tokens:
        raise SystemExit(f"expected {max_tokens} tokens with logprobs, got {len(ids)}")
    streamed_ids = [
        t
        for d in sse_data(stream)
        if isinstance(d, dict)
        for c in d.get("choices", [])
        for t in (c.get("token_ids") or [])
    ]
    if streamed_ids != ids:
        raise SystemExit("streamed and plain replies carry different token ids (not greedy?)")

    out = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "vllm_version": version,
        "served_model": model,
        "request": vllm_request(model, False, max_tokens),
        "stream_request": vllm_request(model, True, max_tokens),
        "agent_request": agent_request(model, max_tokens),
        "prompt_tokens": plain["usage"]["prompt_tokens"],
        "completion_tokens": plain["usage"]["completion_tokens"],
        "models": models.decode(),
        "reply": reply.decode(),
        "stream": stream.decode(),
    }
    FIXTURES.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(out, indent=1) + "\n").encode()
    for stale in (FIXTURES / f"{name}.json", FIXTURES / f"{name}.json.gz"):
        stale.unlink(missing_ok=True)
    if len(text) > GZIP_ABOVE:
        path = FIXTURES / f"{name}.json.gz"
        path.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))  # mtime 0: same bytes, same file
    else:
        path = FIXTURES / f"{name}.json"
        path.write_bytes(text)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--backend", required=True, help="a running vLLM OpenAI server, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--name", default=DEFAULT_FIXTURE)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="generated tokens (exactly: ignore_eos)")
    args = p.parse_args(argv)
    path = asyncio.run(record(args.backend, args.name, args.max_tokens))
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
