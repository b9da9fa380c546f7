"""Judge rewards: a model scores a session, by a rubric, wherever a reward is given (docs/judge.md).

    judge = Judge(JudgeConfig(rubric=Path("rubric.md").read_text(), per="step", samples=3))
    verdict = await judge.reward(client, session_id)     # scores the session, posts the rewards

A judge model (any OpenAI-compatible endpoint, ``url``; by default the served policy itself, through the
proxy) reads the rubric and the conversation, and answers ``SCORE: <n>`` within ``scale``. ``samples`` answers
(one call with ``n``) are combined by their mean or a majority ``vote``; ``per`` scores the whole trajectory
(one reward) or each main-line step (a reward on that step), optionally reading the turn that follows a reply
(``next_turn``: the user's next message, a tool's result), as OpenClaw-RL's process reward does.

Through the proxy, the judge's own calls are recorded in a session of their own (mode ``judge``: never
trained, never in the eval curve), named in the reward's provenance. A judge that cannot be reached, refuses,
or answers no score in most samples raises ``JudgeError``, never a silent 0: the callers end the judged
session as an infrastructure failure (``records.INFRA_FAILURE``) with the error. Each reward carries its
provenance (``RewardAdded.provenance``, exported as ``reward_provenance``): the model, the prompt template and
its hash, the rubric's hash, the scale, samples and aggregate, the judge session.

Used by ``steptap run --reward-judge``, ``steptap tasks run --reward-judge``, ``steptap env run
--reward-judge``, the proxy's ``--reward steptap.adapters.judge:callback`` (at every finish) and any runner
(``Judge.reward``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from steptap.middleware.client import SteptapError
from steptap.middleware.records import Step, Trajectory

# The judge's prompt (a user turn): short, so the template itself travels in each reward's provenance
PROMPT = """{rubric}

<conversation>
{conversation}
</conversation>
{next_turn}
Score {what} by the rubric above. Answer with one line: SCORE: <a number from {lo:g} to {hi:g}>"""
NEXT_TURN = ("\n<next_turn>\n{text}\n</next_turn>\n"
             "(What followed the last assistant turn: read it as feedback.)\n")
WHAT = {"step": "the last assistant turn", "trajectory": "the assistant's work in the whole conversation"}
PROMPT_SHA256 = hashlib.sha256((PROMPT + NEXT_TURN).encode()).hexdigest()
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
MAX_REPLY_BYTES = 1 << 20


class JudgeError(RuntimeError):
    """The judge could not score: unreachable, refused, or no score in most of its answers."""


@dataclass
class JudgeConfig:
    rubric: str  # the rubric's text
    model: str | None = None  # default: the model the proxy serves (through it), required with ``url``
    url: str | None = None  # an OpenAI-compatible base URL (.../v1); None: the served policy, via the proxy
    api_key_env: str | None = None  # with ``url``: the environment variable holding its API key
    scale: tuple[float, float] = (0.0, 10.0)
    samples: int = 1
    aggregate: Literal["mean", "vote"] = "mean"
    per: Literal["trajectory", "step"] = "trajectory"
    next_turn: bool = False  # per step: show the judge the turn after the reply
    max_tokens: int = 64
    temperature: float | None = None  # default: 0 for one sample, 1 for several
    name: str = "judge"  # the reward's name
    max_chars: int = 24_000  # the conversation shown is cut to its last max_chars characters
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        lo, hi = self.scale
        if not (self.rubric.strip() and lo < hi and self.samples >= 1 and self.max_tokens >= 1):
            raise ValueError("a judge needs a rubric, a scale LO < HI, samples >= 1 and max_tokens >= 1")
        if self.url and not self.model:
            raise ValueError("a judge at --judge-url needs --judge-model")


@dataclass
class Verdict:
    rewards: dict[int | None, float]  # step index (None: the trajectory) -> score
    provenance: dict[str, Any]
    session_id: str | None  # the judge session (through the proxy)


def text_of(value: Any) -> str:
    """A message's content as text: a string, or its parts' text (an image part as ``[image]``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(text_of(p.get("text") if isinstance(p, dict) and "text" in p else
                                 "[image]" if isinstance(p, dict) else p) for p in value)
    return "" if value is None else json.dumps(value, default=str)


def _turn(m: dict[str, Any]) -> str:
    calls = m.get("tool_calls") or []
    text = text_of(m.get("content")) + "".join(
        f"\n[tool call] {json.dumps(c.get('function', c), default=str)}" for c in calls)
    return f"[{m.get('role', '?')}] {text}"


def _messages(step: Step) -> list[dict[str, Any]]:
    req = step.request or {}
    msgs = req.get("messages", req.get("input", req.get("prompt")))
    if isinstance(msgs, str):
        return [{"role": "user", "content": msgs}]
    out = [m for m in msgs or [] if isinstance(m, dict)]
    if isinstance(req.get("system"), (str, list)):  # Anthropic's system prompt
        out.insert(0, {"role": "system", "content": req["system"]})
    return out


def _after(step: Step, nxt: Step | None) -> str:
    """What followed ``step``'s reply: the messages the next call added after it."""
    if nxt is None:
        return ""
    later = _messages(nxt)[len(_messages(step)) + 1:]
    return "\n".join(_turn(m) for m in later if m.get("role") != "assistant")


class Judge:
    def __init__(self, cfg: JudgeConfig, rubric_path: str | None = None) -> None:
        self.cfg = cfg
        self.rubric_sha256 = hashlib.sha256(cfg.rubric.encode()).hexdigest()
        self.rubric_file = Path(rubric_path).name if rubric_path else None

    # ---- prompts ------------------------------------------------------------------------------------------
    def prompts(self, traj: Trajectory) -> dict[int | None, str]:
        """What the judge is asked: one prompt per main-line step (per step) or for the trajectory."""
        steps = [s for s in traj.steps if s.status == "ok" and s.call_class != "side"]
        if not steps:
            raise JudgeError(f"session {traj.id} has no step to judge")
        lo, hi = self.cfg.scale
        targets = list(enumerate(steps)) if self.cfg.per == "step" else [(len(steps) - 1, steps[-1])]
        out: dict[int | None, str] = {}
        for pos, step in targets:
            talk = "\n".join(_turn(m) for m in _messages(step)) + "\n" + _turn(
                {"role": "assistant", **step.response})
            nxt = _after(step, steps[pos + 1] if pos + 1 < len(steps) else None) if self.cfg.next_turn else ""
            out[step.index if self.cfg.per == "step" else None] = PROMPT.format(
                rubric=self.cfg.rubric.strip(), conversation=talk[-self.cfg.max_chars:], lo=lo, hi=hi,
                what=WHAT[self.cfg.per], next_turn=NEXT_TURN.format(text=nxt[-4000:]) if nxt else "")
        return out

    def score(self, answers: list[str]) -> tuple[float, list[float]]:
        """The combined score of the samples' answers, and each valid one; ``JudgeError`` unless most are."""
        lo, hi = self.cfg.scale
        valid = []
        for text in answers:
            found = _SCORE.findall(text or "")
            raw = found[-1] if found else (text or "").strip()
            try:
                value = float(raw)
            except ValueError:
                continue
            if lo <= value <= hi:
                valid.append(value)
        if len(valid) * 2 <= len(answers):
            bad = next((a for a in answers if a), "")
            raise JudgeError(f"the judge answered no score from {lo:g} to {hi:g} in "
                             f"{len(answers) - len(valid)} of {len(answers)} samples (e.g. {bad[:200]!r})")
        if self.cfg.aggregate == "vote":
            counts = Counter(valid).most_common()
            top = [v for v, n in counts if n == counts[0][1]]
            return statistics.fmean(top), valid  # a tie: the mean of the most common
        return statistics.fmean(valid), valid

    def provenance(self, model: str, session_id: str | None, votes: list[float] | None) -> dict[str, Any]:
        c = self.cfg
        out: dict[str, Any] = {
            "model": model, "endpoint": c.url or "proxy", "prompt": PROMPT, "prompt_sha256": PROMPT_SHA256,
            "rubric_sha256": self.rubric_sha256, "rubric_file": self.rubric_file,
            "scale": f"{c.scale[0]:g}..{c.scale[1]:g}", "samples": c.samples, "aggregate": c.aggregate,
            "per": c.per, "next_turn": c.next_turn, "temperature": self._temperature(),
            "judge_session": session_id,
        }
        if votes is not None:
            out["votes"] = ",".join(f"{v:g}" for v in votes)[:500]
        return out

    def _temperature(self) -> float:
        if self.cfg.temperature is not None:
            return self.cfg.temperature
        return 0.0 if self.cfg.samples == 1 else 1.0

    # ---- calls --------------------------------------------------------------------------------------------
    async def judge(self, client: Any, traj: Trajectory) -> Verdict:
        """Score ``traj`` (full steps). Through the proxy the calls go in a judge session of their own,
        finished (or aborted, with the error) before this returns."""
        prompts = self.prompts(traj)
        session = None
        try:
            if self.cfg.url is not None:
                base, key = self.cfg.url.rstrip("/"), os.environ.get(self.cfg.api_key_env or "", "")
            else:
                session = await client.open_session(mode="judge", metadata={
                    "judge_of": traj.id, "judge": self.cfg.name, "rubric_sha256": self.rubric_sha256})
                base, key = session.base_url.rstrip("/"), session.api_key
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
            async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
                model = self.cfg.model or await _served(http, base, key)
                slots = asyncio.Semaphore(4)

                async def one(prompt: str) -> list[str]:
                    async with slots:
                        return await self._ask(http, base, key, model, prompt)

                answers = await asyncio.gather(*(one(p) for p in prompts.values()))
            scored = {k: self.score(a) for k, a in zip(prompts, answers, strict=True)}
        except (JudgeError, aiohttp.ClientError, TimeoutError, OSError, SteptapError) as exc:
            where = self.cfg.url or "the proxy"
            error = exc if isinstance(exc, JudgeError) else JudgeError(
                f"the judge at {where} failed: {type(exc).__name__}: {exc}")
            if session is not None:
                await _close(client, session.id, "aborted", str(error))
            raise error from None
        if session is not None:
            await _close(client, session.id, "finished")
        sid = session.id if session is not None else None
        votes = scored[None][1] if None in scored else None
        return Verdict({k: v for k, (v, _) in scored.items()}, self.provenance(model, sid, votes), sid)

    async def _ask(self, http: aiohttp.ClientSession, base: str, key: str, model: str, prompt: str
                   ) -> list[str]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "n": self.cfg.samples,
                "max_tokens": self.cfg.max_tokens, "temperature": self._temperature()}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with http.post(f"{base}/chat/completions", json=body, headers=headers) as resp:
            raw = await resp.content.read(MAX_REPLY_BYTES + 1)
            if resp.status >= 400 or len(raw) > MAX_REPLY_BYTES:
                raise JudgeError(f"the judge's model call failed ({resp.status}): {raw[:300]!r}")
        try:
            return [text_of((c.get("message") or {}).get("content")) for c in json.loads(raw)["choices"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise JudgeError(f"the judge's reply is not a chat completion: {raw[:200]!r}") from exc

    async def reward(self, client: Any, session_id: str) -> Verdict:
        """Judge the open session ``session_id`` and post its rewards (with their provenance)."""
        verdict = await self.judge(client, await client.get_session(session_id))
        for step, value in verdict.rewards.items():
            await client.add_reward(session_id, value, name=self.cfg.name, step=step,
                                    provenance=verdict.provenance)
        return verdict


async def _served(http: aiohttp.ClientSession, base: str, key: str) -> str:
    async with http.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"} if key else {}) as resp:
        data = await resp.json(content_type=None)
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as exc:
        raise JudgeError(f"no model served at {base} to judge with (--judge-model)") from exc


async def _close(client: Any, session_id: str, status: str, error: str | None = None) -> None:
    try:
        await client.finish(session_id, status=status, error=error)
    except Exception:  # noqa: BLE001 - the judge's own session: its idle timeout closes it otherwise
        pass


# ---- command-line flags (steptap run, steptap tasks run, steptap env run) -------------------------------
def add_judge_flags(p: Any, reward_group: Any = None) -> None:
    """``--reward-judge RUBRIC`` (in ``reward_group``, beside the other reward sources) and its settings."""
    (reward_group or p).add_argument("--reward-judge", metavar="RUBRIC_FILE", default=None,
                                     help="a judge model scores the session by this rubric (docs/judge.md)")
    p.add_argument("--judge-model", default=None,
                   help="the judge's model (default: the one the proxy serves)")
    p.add_argument("--judge-url", default=None,
                   help="an OpenAI-compatible base URL for the judge (default: the served policy, through "
                        "the proxy)")
    p.add_argument("--judge-key-env", default=None, help="with --judge-url: the variable holding its API key")
    p.add_argument("--judge-scale", default="0:10", help="the scores the judge may give, LO:HI")
    p.add_argument("--judge-samples", type=int, default=1, help="answers per judgment (k)")
    p.add_argument("--judge-aggregate", choices=("mean", "vote"), default="mean",
                   help="how the k answers combine: their mean, or a majority vote")
    p.add_argument("--judge-per", choices=("trajectory", "step"), default="trajectory",
                   help="one reward for the trajectory, or one on each main-line step")
    p.add_argument("--judge-next-turn", action="store_true",
                   help="per step: the judge also reads the turn that followed the reply (the user's next "
                        "message)")
    p.add_argument("--judge-max-tokens", type=int, default=64, help="the judge's answer length")
    p.add_argument("--judge-temperature", type=float, default=None,
                   help="default: 0 for one sample, 1 for several")


def judge_from_args(args: Any, fail: Callable[[str], Any]) -> Judge | None:
    """The judge the flags ask for (None without ``--reward-judge``); ``fail(message)`` on a bad flag."""
    if not args.reward_judge:
        return None
    try:
        rubric = Path(args.reward_judge).read_text()
        lo, _, hi = args.judge_scale.partition(":")
        cfg = JudgeConfig(rubric=rubric, model=args.judge_model, url=args.judge_url,
                          api_key_env=args.judge_key_env, scale=(float(lo), float(hi)),
                          samples=args.judge_samples, aggregate=args.judge_aggregate, per=args.judge_per,
                          next_turn=args.judge_next_turn, max_tokens=args.judge_max_tokens,
                          temperature=args.judge_temperature)
    except (OSError, ValueError) as exc:
        return fail(f"--reward-judge: {exc}")
    return Judge(cfg, args.reward_judge)


# ---- the proxy's reward callback: steptap serve --reward steptap.adapters.judge:callback -------------------
CONFIG_ENV = "STEPTAP_JUDGE_CONFIG"  # a JSON file: JudgeConfig's fields ("rubric_file" for the rubric's text)


def config_file(path: str) -> Judge:
    data = json.loads(Path(path).read_text())
    rubric_file = data.pop("rubric_file", None)
    if rubric_file:
        data["rubric"] = Path(rubric_file).read_text()
    if "scale" in data:
        data["scale"] = tuple(data["scale"])
    return Judge(JudgeConfig(**data), rubric_file)


async def callback(traj: Trajectory) -> None:
    """At each finish, the judge scores the session (``$STEPTAP_JUDGE_CONFIG``; the proxy at ``$STEPTAP_URL``
    with the control token from the environment): its rewards and their provenance go into the trajectory.
    A judge that fails raises ``RewardUnavailable``: the session ends as an infrastructure failure."""
    from steptap.middleware.client import SteptapClient, default_control_token
    from steptap.middleware.exceptions import RewardUnavailable

    if traj.mode != "train":  # the judge's own session finishes too: never judged
        return
    judge = config_file(os.environ[CONFIG_ENV])
    async with SteptapClient(os.environ.get("STEPTAP_URL", ""), default_control_token()) as client:
        try:
            verdict = await judge.judge(client, traj)
        except JudgeError as exc:
            raise RewardUnavailable(str(exc)) from None
    at = {s.index: i for i, s in enumerate(traj.steps)} if judge.cfg.per == "step" else {}
    for step, value in verdict.rewards.items():  # the view's steps share their rewards with the trajectory's
        (traj.rewards if step is None else traj.steps[at[step]].rewards)[judge.cfg.name] = value
    traj.reward_provenance[judge.cfg.name] = verdict.provenance


__all__ = ["Judge", "JudgeConfig", "JudgeError", "Verdict", "add_judge_flags", "callback", "judge_from_args"]
