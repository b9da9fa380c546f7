"""Run health: the figures that say whether a run can learn, and the rules that name what is wrong in plain
words. One definition, read by the learner's check (learner/health.py: it warns after the first update and
stops a run that cannot learn), the console, ``/metrics``, ``steptap up``'s live view and ``steptap doctor``
(docs/health.md says what each figure means and what to do about it).

Two sources, each computed from what its owner already sees:

- the learner, per batch: a row's ``health`` dict in its metrics file (learner/health.py writes it with
  each update, and for a batch with nothing to train): groups with reward variance, response tokens that
  reached the loss and why the rest did not, replies cut by ``max_tokens``, the mean |vLLM logprob - learner
  logprob|, how many versions the trained tokens lag;
- the proxy: sessions opened, finished, aborted, open, held for a pending reward, how long the quietest open
  session and the oldest held one have waited (``ProxyFigures``, from its counters).

Pure: plain dicts and numbers in, ``Finding``s out; no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

Level = Literal["warn", "stop"]


class Thresholds(NamedTuple):
    window: int = 5  # batches a stop needs: nothing learnable in each of the last `window`
    gap_nats: float = 0.5  # mean |vLLM - learner| logprob beyond this: the learner scores other weights
    min_trained_share: float = 0.5  # a warning when fewer of the generated tokens reach the loss
    cut_share: float = 0.9  # replies cut by max_tokens, named when rewards do not vary
    stall_s: float = 300.0  # an open session silent this long, a pending reward this old
    aborted_share: float = 0.5  # sessions ending aborted (an agent, a judge or a grader failing)


DEFAULTS = Thresholds()


class Finding(NamedTuple):
    cause: str  # one of CAUSES
    level: Level
    text: str  # what is wrong and what to do, in plain words


CAUSES = ("no_variance", "solved", "nothing_trained", "few_trained", "cut", "logprob_gap", "versions_stuck",
          "sessions_unfinished", "rewards_pending", "aborted")

# Why a response token did not reach the loss (learner/rows.py's causes), and what to do about it
DROP_HINTS = {
    "dropped_greedy": "sampled greedily (temperature 0): a greedy reply has no distribution to learn from; "
                      "let the agents sample (temperature > 0)",
    "dropped_stale": "older than max_staleness versions: the agents sample faster than the learner trains; "
                     "raise max_staleness or use stale_mode = \"downweight\"",
    "dropped_side": "side calls (titles, summaries): they train only in sessions opened with train: \"all\"",
    "dropped_unreproducible": "sampled with min_p, penalties, a logit bias or constrained decoding (a "
                              "grammar, a forced tool call): the learner cannot recompute that distribution",
    "dropped_truncated": "sampled with top_p/top_k while truncation_mode = \"drop\"",
    "dropped_failed": "failed model calls",
    "dropped_empty": "empty replies",
    "dropped_aborted": "sessions that ended aborted (or an infrastructure failure): set train_aborted to "
                       "train aborted ones",
    "dropped_infra_error": "infrastructure failures (a sandbox, an agent that did not start, a verifier or a "
                           "judge that failed): never trained",
    "dropped_timed_out": "sessions closed by their idle timeout: finish them, or set train_aborted",
    "dropped_curated": "trajectories curation excluded",
    "dropped_curated_step": "steps curation excluded",
    "skipped_anonymous": "calls in no session (anonymous): open sessions for the agents, or pass "
                         "--train-anonymous",
    "dropped_small_group": "groups that timed out with too few members (min_group_members)",
    "dropped_unresolvable": "damaged trajectories (a delta step without its base)",
    "dropped_image_text_model": "steps with images for a text-only policy",
}


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def batch_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of a learner's metrics file that describe a batch (each has a ``health`` dict)."""
    return [r for r in rows if isinstance(r.get("health"), Mapping)]


def _drops(h: Mapping[str, Any]) -> Counter[str]:
    tokens = h.get("tokens") or {}
    return Counter({k: v for k, v in tokens.items() if k not in ("generated", "trained") and v})


def _cut_note(rows: Sequence[Mapping[str, Any]], t: Thresholds) -> str | None:
    replies = sum(r["health"].get("replies", 0) for r in rows)
    cut = sum(r["health"].get("replies_cut", 0) for r in rows)
    if not replies or cut / replies < t.cut_share:
        return None
    limit = rows[-1]["health"].get("cut_max_tokens")
    at = f" at max_tokens={limit}" if limit else " at max_tokens"
    return (f"{_pct(cut, replies)} of the replies were cut{at}: the agents never finish an answer "
            "(raise max_tokens)")


def _variance(rows: Sequence[Mapping[str, Any]], t: Thresholds) -> list[Finding]:
    updates = [r for r in rows if r["health"].get("groups")]
    if not updates or updates[-1]["health"].get("groups_varied"):
        return []
    last = updates[-t.window:]
    h = last[-1]["health"]
    lo, hi = h.get("reward_min"), h.get("reward_max")
    if _solved(updates, lo, hi):
        return _solved_findings(last, lo, t)
    scope = "a group" if h.get("scope", "group") == "group" else "a batch"
    why = (f"every episode got {lo:g}" if lo is not None and lo == hi
           else "rewards differ between groups but never inside one (GRPO compares a group's members)")
    if h.get("unrewarded") and h.get("unrewarded") == h.get("trajectories"):
        why += ": no reward reached any of them (your reward command printed nothing, the agent wrote no " \
               "reward file, or nothing called the rewards route)"
    cut = _cut_note(last, t)
    if cut:
        why += f"; {cut}"
    varied = sum(bool(r["health"].get("groups_varied")) for r in last)
    text = (f"{varied} of the last {len(last)} updates had {scope} with reward variance: {why}. With equal "
            "rewards every advantage is 0 and nothing is learned")
    stop = len(last) >= t.window and varied == 0
    out = [Finding("no_variance", "stop" if stop else "warn", text)]
    if cut:
        out.append(Finding("cut", "warn", cut[0].upper() + cut[1:]))
    return out


def _solved(updates: Sequence[Mapping[str, Any]], lo: Any, hi: Any) -> bool:
    """Every episode of the latest batch got the best reward of the run, after groups did vary: the run
    reached the top of its task, which is its aim, not a fault (a run whose rewards never varied is not)."""
    if lo is None or lo != hi or not any(r["health"].get("groups_varied") for r in updates):
        return False
    best = max((r["health"]["reward_max"] for r in updates if r["health"].get("reward_max") is not None),
               default=lo)
    return bool(lo >= best)


def _solved_findings(last: Sequence[Mapping[str, Any]], top: float, t: Thresholds) -> list[Finding]:
    if len(last) < t.window or any(r["health"].get("groups_varied") for r in last):
        return []  # a batch at the top between batches that vary: still learning
    return [Finding("solved", "warn",
                    f"every episode got {top:g}, the best reward of the run, in each of the last {len(last)} "
                    "updates: the task is solved at this reward and nothing more is learned from it (give "
                    "the agents harder tasks, or stop the run)")]


def _tokens(rows: Sequence[Mapping[str, Any]], t: Thresholds) -> list[Finding]:
    last = rows[-t.window:]
    generated = sum((r["health"].get("tokens") or {}).get("generated", 0) for r in last)
    trained = sum((r["health"].get("tokens") or {}).get("trained", 0) for r in last)
    drops: Counter[str] = sum((_drops(r["health"]) for r in last), Counter())
    if not generated and not drops or generated and trained / generated >= t.min_trained_share:
        return []
    causes = "; ".join(f"{n} {cause}" + (f" ({DROP_HINTS[cause]})" if cause in DROP_HINTS else "")
                       for cause, n in drops.most_common(3))
    text = (f"{trained} of {generated} generated tokens reached the loss in the last {len(last)} "
            f"batches ({_pct(trained, generated)}); the rest: {causes or 'none counted'}")
    if trained:
        return [Finding("few_trained", "warn", text)]
    stop = len(last) >= t.window and all(not (r["health"].get("tokens") or {}).get("trained") for r in last)
    return [Finding("nothing_trained", "stop" if stop else "warn", text + ". Nothing is learned")]


def _gap(rows: Sequence[Mapping[str, Any]], t: Thresholds) -> list[Finding]:
    measured = [r for r in rows if r["health"].get("gap_tokens")]
    if not measured:
        return []
    first, last = measured[0]["health"], measured[-1]["health"]
    cause = ("the learner does not score the tokens with the weights vLLM sampled them with: a different "
             "model or weights (--model-dir), another dtype, or a swap that did not take")
    if first["logprob_gap"] > t.gap_nats:
        return [Finding("logprob_gap", "stop",
                        f"the learner's logprobs differ from vLLM's by {first['logprob_gap']:.3g} nats on "
                        f"average over {first['gap_tokens']} tokens of its first batch: {cause}. Training on "
                        "them uses a wrong behaviour policy")]
    if last["logprob_gap"] > t.gap_nats:
        return [Finding("logprob_gap", "warn",
                        f"the learner's logprobs differ from vLLM's by {last['logprob_gap']:.3g} nats on "
                        f"average over {last['gap_tokens']} tokens of the current version: {cause}")]
    return []


def _versions(rows: Sequence[Mapping[str, Any]], t: Thresholds) -> list[Finding]:
    seen = [r for r in rows if r["health"].get("newest_version") is not None]
    if len(seen) <= t.window:
        return []
    first = seen[0]["health"]["newest_version"]
    published = seen[-1].get("policy_version")
    newest = max(r["health"]["newest_version"] for r in seen[-t.window:])
    if not isinstance(published, int) or published < first + t.window or newest > first:
        return []
    return [Finding("versions_stuck", "warn",
                    f"the learner published up to version {published}, but the newest trained token is still "
                    f"version {newest}: new weights do not reach the agents (a swap that failed, or agents "
                    "on a proxy the learner does not publish to)")]


def learner_findings(rows: Iterable[Mapping[str, Any]], t: Thresholds = DEFAULTS) -> list[Finding]:
    """What the learner's rows say (its metrics file, oldest first)."""
    batches = batch_rows(rows)
    if not batches:
        return []
    return [*_gap(batches, t), *_variance(batches, t), *_tokens(batches, t), *_versions(batches, t)]


class ProxyFigures(NamedTuple):
    opened: int = 0  # named sessions opened
    finished: int = 0  # trajectories closed finished
    aborted: int = 0  # ... any other way: aborted, timed out, an infrastructure failure
    open: int = 0  # named sessions open now
    held: int = 0  # finished sessions waiting for a pending reward
    idle_s: float = 0.0  # the longest an open session has gone without a call
    held_s: float = 0.0  # the oldest held trajectory's wait
    replies: int = 0  # recorded steps
    cut: int = 0  # of them, cut by max_tokens
    error: str = ""  # the latest aborted session's error, when known


def proxy_figures(values: Mapping[str, float]) -> ProxyFigures:
    """A proxy's figures from its ``/metrics`` (``metrics.parse_text``): what the learner and the live view
    read."""
    from steptap.middleware import metrics as m

    def get(name: str) -> float:
        return float(values.get(name, 0.0))

    closed = m.sample(m.TRAJECTORIES, "total")
    ended = sum(v for k, v in values.items() if k.startswith(closed + "{") and k != closed + "{finished}")
    return ProxyFigures(
        opened=int(get(m.sample(m.SESSIONS_OPENED, "total") + "{false}")),
        finished=int(get(closed + "{finished}")),
        aborted=int(ended),
        open=int(get(m.SESSIONS_OPEN)), held=int(get(m.HELD_TRAJECTORIES)),
        idle_s=get(m.IDLE_MAX), held_s=get(m.HELD_MAX),
        replies=int(get(m.sample(m.STEPS, "total"))), cut=int(get(m.sample(m.REPLIES_CUT, "total"))))


def proxy_findings(p: ProxyFigures, t: Thresholds = DEFAULTS) -> list[Finding]:
    """What the proxy's figures say."""
    out = []
    if p.open and p.idle_s >= t.stall_s:
        out.append(Finding(
            "sessions_unfinished", "warn",
            f"{p.open} sessions are open ({p.opened} opened, {p.finished + p.aborted} closed) and one has "
            f"made no call for {p.idle_s / 60:.1f} min: a session reaches the learner only once it finishes "
            "(call POST /sessions/<id>/finish when the episode ends, or open sessions with an "
            "idle_timeout_s)"))
    if p.held and p.held_s >= t.stall_s:
        out.append(Finding(
            "rewards_pending", "warn",
            f"{p.held} finished sessions wait for a pending reward, the oldest for {p.held_s / 60:.1f} min: "
            "none of them trains until its reward arrives (POST /sessions/<id>/rewards, the console's "
            "rating) or its deadline passes (reward_deadline_s)"))
    closed = p.finished + p.aborted
    if closed >= 4 and p.aborted / closed >= t.aborted_share:
        why = f" (latest error: {p.error[:300]})" if p.error else ""
        out.append(Finding(
            "aborted", "warn",
            f"{p.aborted} of {closed} sessions ended aborted, timed out or failed{why}: they do not "
            "train (an agent that crashes, a judge or grader that fails: an infrastructure failure)"))
    return out


def diagnose(rows: Iterable[Mapping[str, Any]], proxy: ProxyFigures | None = None,
             t: Thresholds = DEFAULTS) -> list[Finding]:
    """Every finding, stops first."""
    found = learner_findings(rows, t) + (proxy_findings(proxy, t) if proxy is not None else [])
    return sorted(found, key=lambda f: f.level != "stop")


def summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The latest batch's figures as shares, for a view (None where unknown)."""
    batches = batch_rows(rows)
    if not batches:
        return {}
    h = batches[-1]["health"]
    tokens = h.get("tokens") or {}

    def share(part: Any, whole: Any) -> float | None:
        return round(part / whole, 4) if isinstance(part, (int, float)) and whole else None

    return {
        "groups_varied": share(h.get("groups_varied"), h.get("groups")),
        "tokens_trained": share(tokens.get("trained", 0), tokens.get("generated")),
        "replies_cut": share(h.get("replies_cut"), h.get("replies")),
        "logprob_gap": h.get("logprob_gap"),
        "version_lag": h.get("version_lag_mean"),
        "dropped": dict(_drops(h).most_common(4)),
    }


def as_dicts(findings: Iterable[Finding]) -> list[dict[str, str]]:
    return [f._asdict() for f in findings]
