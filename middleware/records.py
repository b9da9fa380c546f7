"""The record schema: the contract between the proxy, the log, the stream and the learner.

Every record is a ``msgspec.Struct``. Change this module deliberately: new fields always get a default (so old
logs still decode), and a change in meaning bumps ``SCHEMA_VERSION``. Encoders and decoders are built once
here and reused everywhere.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal

import msgspec

# 2: Sampling records what else shapes the distribution (min_p, penalties, constraints).
# 3: an anonymous call (no reward callback) is logged as its one-step Trajectory alone
# (``steps_logged=False``). 4: delta steps: a step whose prompt extends the previous call's holds only what is
# new (``Step.delta``), and a
#    finished Trajectory refers to its logged steps (``step_refs``) instead of embedding them (``delta.py``);
#    a step whose generation spans a weight swap records where each policy version starts (``version_spans``).
#    Later, with no bump (defaulted fields: older v4 records decode as main-line steps of a session that
# trains
#    on its main line): ``Step.call_class`` / ``call_rule`` / ``branch`` (sessions/classify.py) and the
#    session's ``train`` and ``side_models`` (on ``Trajectory`` and ``SessionOpened``).
# 5: the choices of one call (``n > 1``) record its request once: each choice after the first is a delta of
#    the first (``Delta.kind == "choice"``), whose prompt ids and request it shares.
# 6: a trajectory's ``reward_sources``, a reward's ``source`` and ``late``, and the held-trajectory records
#    (``Held``, ``HeldDropped``: a finish whose reward is pending, sessions/holding.py).
# 7: images: a step names each image its prompt showed the model (``Step.images``, ``ImageRef``); the bytes
#    are stored once, by content, beside the log; the logged request refers to them instead of holding them.
# 8: a delta step's list may start with only some of its base's items (``Delta.tails``: the first k of them,
#    then its own): an agent that edits its last message each call logs from that message on, not all again;
#    a main-line step that does not extend the call before but shares most of its prompt is a delta of it
#    (``Delta.kind == "prefix"``: the base's first ``shared`` prompt ids + its own).
#    Later, with no bump (defaulted fields and one more ``Mode``): a reward's provenance
#    (``RewardAdded.provenance``, ``Trajectory.reward_provenance``: a judge's model, prompt and rubric
#    hash) and the ``judge`` mode (a judge's own calls, never trained).
# 9: task episodes (adapters/tasks): a trajectory may end as ``infra_error`` (an infrastructure failure, never
#    a reward, never trained: ``infra_cause`` says which), and carries how its agent and verifier ended
#    (``task_run``: exit codes, seconds, the tails of their output).
SCHEMA_VERSION = 9

CallClass = Literal["main", "side", "branch"]  # which line of its session a call is on (sessions/classify.py)
TrainOn = Literal["main", "all"]  # which steps of a session train: its main line (and branches), or every one
PrefixCause = Literal["extends", "first", "history_edited", "rerendered", "truncated"]
StepStatus = Literal["ok", "failed"]
TrajectoryStatus = Literal["running", "finished", "aborted", "timed_out", "infra_error"]
# Why an episode is an infrastructure error (status ``infra_error``): its sandbox did not start, its agent
# died before its first model call, its verifier crashed (no reward file) or ran past its timeout, the run was
# interrupted (Ctrl-C: the episode is run again when the run resumes), its reward could not be made
# (a judge or grader failed: exceptions.RewardUnavailable), or another cause
InfraCause = Literal["sandbox", "agent_start", "verifier_crash", "verifier_timeout", "interrupted",
                     "reward_unavailable", "other"]
# A trajectory whose reward could not be made ends with this status, the failure as its error
INFRA_FAILURE: TrajectoryStatus = "infra_error"
# Where a trajectory-level reward came from: the --reward callback, the control API (a script, a finish's own
# reward), a person (the console, or a script saying so), or a pending reward's deadline default
RewardSource = Literal["callback", "http", "human", "default"]
# "eval": evaluated, never trained; "judge": a judge model's own calls scoring another session
# (adapters/judge.py), never trained, never in the eval curve
Mode = Literal["train", "eval", "judge"]
# A reward's provenance: flat, short values (a judge's model, prompt and rubric hash, its scale and samples)
Provenance = dict[str, str | int | float | bool | None]


class Record(msgspec.Struct, kw_only=True, omit_defaults=False, tag_field="type"):
    """Base of every record.

    ``kw_only`` lets subclasses add defaulted fields in any order; ``tag_field`` makes the log a tagged union
    (each record carries ``"type"``), so one decoder reads any record kind.
    """


class Sampling(msgspec.Struct, kw_only=True):
    """The sampling parameters actually sent to the backend (after any forced training values): everything
    that shapes the distribution the response tokens were drawn from. Defaults are the neutral values (no
    penalty, no bias), so a v1 record decodes as what it was: a request that set none of them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    forced: bool = False  # the proxy overrode the agent's values (--force-sampling)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS (and stop tokens) masked until this many tokens
    logit_bias: dict[str, float] = {}
    # Request keys that constrain the tokens in ways no scalar above describes (structured outputs, bad
    # words, allowed token ids, a forced tool call): the learner cannot reproduce that distribution.
    constraints: list[str] = []


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StepError(msgspec.Struct, kw_only=True):
    message: str
    type: str = "backend_error"
    code: str | None = None


class Delta(msgspec.Struct, kw_only=True):
    """How a logged step extends an earlier step of its trajectory (the base): its ``prompt_token_ids`` are
    only the ids after the base's prompt + response, and its ``request`` only what differs (``delta.py``)."""

    base: int  # the index of the step it extends
    # The full request's keys in order; a key missing from ``request`` is the base's value
    keys: list[str] = []
    tails: dict[str, int] = {}  # a list that starts with this many items of the base's list of that key
    # "extends": its prompt is the base's prompt + response + its own ids (a later call). "choice" (v5):
    # another choice of the base's call (n > 1): its prompt is the base's first ``shared`` ids + its own.
    # "prefix" (v8): a later call that does not extend the base but starts with its first ``shared`` ids
    kind: Literal["extends", "choice", "prefix"] = "extends"
    shared: int = 0


class ImageRef(msgspec.Struct, kw_only=True):
    """One image a step's prompt showed the model, in prompt order (the order vLLM expanded its placeholder
    tokens in ``prompt_token_ids``). The bytes are stored once by content beside the log (``log/images.py``);
    readers resolve a ref by its digest."""

    sha256: str  # hex digest of the image's bytes as the model received them
    mime: str = ""  # image/png, image/jpeg, ...
    width: int = 0
    height: int = 0
    size: int = 0  # bytes


# What a logged request holds where the agent sent an image's data or URL: the image's digest (its bytes are
# in the image store beside the log, log/images.py), so a screenshot replayed every turn is stored once.
IMAGE_REF_PREFIX = "steptap-image:sha256:"


def image_digest(data: bytes) -> str:
    """What names an image: the sha256 hex digest of its bytes."""
    return hashlib.sha256(data).hexdigest()


def is_digest(text: str) -> bool:
    """A sha256 hex digest (64 lowercase hex digits): what names an image."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def ref_of(sha256: str) -> str:
    """The reference a logged request holds in place of an image's data (``digest_of_ref`` reads it)."""
    return IMAGE_REF_PREFIX + sha256


def digest_of_ref(value: Any) -> str | None:
    """The digest a ``ref_of`` string names, else None."""
    if isinstance(value, str) and value.startswith(IMAGE_REF_PREFIX):
        sha = value[len(IMAGE_REF_PREFIX):]
        return sha if is_digest(sha) else None
    return None


class StepRef(msgspec.Struct, array_like=True):
    """A finished trajectory's reference to one of its logged ``Step`` records."""

    at: str  # the cursor where the Step record starts
    rewards: dict[str, float] = {}  # its rewards when the trajectory finished (given after it was logged)
    # [call_class, call_rule] it finished with, when a later call reclassified it (a tool-less first call
    # superseded by an agent loop: ["side", "superseded"], sessions/classify.py); None: as logged
    call: list[str] | None = None


class Step(Record, tag="step"):
    """One model call, one choice (a request with ``n > 1`` gives one step per choice)."""

    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = ""
    index: int = 0
    choice: int = 0  # which choice of an n>1 request this step is
    group_id: str | None = None
    policy_version: int = 0
    model: str = ""  # as requested by the agent
    served_model: str = ""  # as served by the backend
    backend: str = ""  # the backend URL that served it
    endpoint: str = "chat.completions"  # or "completions"
    request: dict[str, Any] = {}  # messages/prompt, tools and the agent's parameters exactly as sent
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    prompt_token_ids: list[int] = []
    response_token_ids: list[int] = []
    response_logprobs: list[float] = []  # one per response token
    finish_reason: str | None = None
    response: dict[str, Any] = {}  # the assistant message: content, tool_calls, reasoning_content
    status: StepStatus = "ok"
    error: StepError | None = None
    prefix: PrefixCause = "first"
    rewards: dict[str, float] = {}  # named per-step (process) reward components
    started_at: float = 0.0  # unix seconds
    latency_s: float = 0.0
    usage: Usage = msgspec.field(default_factory=Usage)
    # what the proxy did to the call that the request does not show: fields accepted but not honoured,
    # a translation choice (docs/protocols.md)
    notes: list[str] = []
    delta: Delta | None = None  # set only in the log's form of a step (v4); readers hand out full steps
    # [[start, version], ...]: response token ``start`` on was sampled by ``version`` (a generation that spans
    # a ``keep`` weight swap). Empty: every token is ``policy_version``'s (every step before v4).
    version_spans: list[list[int]] = []
    call_class: CallClass = "main"  # main line, a side call beside it, or the call that starts a new branch
    # The rule that decided call_class (sessions/classify.py); "" in records made before it
    call_rule: str = ""
    branch: int = 0  # the main line's branch this step is on (a compaction starts the next)
    images: list[ImageRef] = []  # the images its prompt showed the model, in prompt order (v7)

    def token_versions(self) -> list[int]:
        """The policy version that sampled each response token."""
        return token_versions(self.version_spans, self.policy_version, len(self.response_token_ids))


class StepVersions(msgspec.Struct):
    """A logged ``Step`` read for its token versions alone: the rest of the record (its prompt ids above all)
    is skipped by the decoder, never built (the console's index reads every finished session this way)."""

    policy_version: int = 0
    response_token_ids: list[int] = []
    version_spans: list[list[int]] = []


def newest_version(step: Step | StepVersions) -> int:
    """The newest policy version that sampled one of a step's tokens (its own when it has none)."""
    return max(token_versions(step.version_spans, step.policy_version, len(step.response_token_ids))
               or [step.policy_version])


def token_versions(spans: list[list[int]], version: int, n: int) -> list[int]:
    """Per-token versions of ``n`` tokens from ``[[start, version], ...]`` (empty: all ``version``)."""
    out = [version] * n
    for i, (start, v) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else n
        out[max(0, start):max(0, end)] = [v] * max(0, min(end, n) - max(0, start))
    return out[:n]


class ProcessEnd(msgspec.Struct, kw_only=True):
    """How one process of a task episode ended (its agent, its verifier)."""

    exit_code: int | None = None  # None: killed at its timeout, or never started
    timed_out: bool = False
    seconds: float = 0.0
    output: str = ""  # the tail of what it printed (stdout and stderr together)


class TaskRun(msgspec.Struct, kw_only=True):
    """A task episode's processes (adapters/tasks): the agent, then the verifier that gave its reward."""

    agent: ProcessEnd | None = None
    verifier: ProcessEnd | None = None


class Trajectory(Record, tag="trajectory"):
    """One session: the steps of one agent run, its rewards and how it ended."""

    schema_version: int = SCHEMA_VERSION
    id: str = ""
    group_id: str | None = None
    group_size: int | None = None  # expected members of the group, or None
    mode: Mode = "train"  # eval trajectories are never trained on
    metadata: dict[str, Any] = {}
    steps: list[Step] = []
    rewards: dict[str, float] = {}  # named trajectory-level components; the scalar reward is their sum
    status: TrajectoryStatus = "running"
    error: str | None = None  # e.g. a reward callback that raised
    anonymous: bool = False
    created_at: float = msgspec.field(default_factory=time.time)
    finished_at: float | None = None
    idle_timeout_s: float | None = None
    # True: each step was logged as a Step record when it was made (every session before v3). False: the steps
    # are in this record only (v3: an anonymous call without a reward callback writes one record, not two).
    steps_logged: bool = True
    # v4: the logged steps, in order, instead of ``steps`` (a reader resolves them: ``delta.resolve``).
    step_refs: list[StepRef] = []
    train: TrainOn = "main"  # which of its steps the learner trains on (side calls only with "all")
    # Model names whose calls are side calls in this session (besides the proxy's)
    side_models: list[str] = []
    reward_sources: dict[str, RewardSource] = {}  # trajectory-level reward name -> where it came from
    # reward name (trajectory or step level) -> what made it, when its giver said (a judge: model, prompt and
    # rubric hashes, scale, samples)
    reward_provenance: dict[str, Provenance] = {}
    infra_cause: InfraCause | None = None  # v9: with status infra_error, why (the reason is ``error``)
    task_run: TaskRun | None = None  # v9: a task episode's agent and verifier, as they ended

    @property
    def reward(self) -> float:
        return float(sum(self.rewards.values()))


# Session events: what the log needs, besides steps, to rebuild open sessions after a restart.


class SessionOpened(Record, tag="session_opened"):
    """A session opened: what its trajectory starts as (``trajectory``), its key and its mode. The one place a
    live session's ``Trajectory`` comes from, at open and when a restart rebuilds it from the log."""

    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = ""
    group_id: str | None = None
    group_size: int | None = None
    mode: Mode = "train"
    metadata: dict[str, Any] = {}
    anonymous: bool = False
    idle_timeout_s: float | None = None
    key: str | None = None  # the session API key (hash-free: the log is as trusted as the control token)
    tito: bool = False  # token-in-token-out mode, asked at open (kept across a restart)
    train: TrainOn = "main"
    side_models: list[str] = []
    at: float = msgspec.field(default_factory=time.time)

    def trajectory(self) -> Trajectory:
        """The trajectory this session starts as (no steps yet), created when it opened."""
        return Trajectory(id=self.trajectory_id, group_id=self.group_id, group_size=self.group_size,
                          mode=self.mode, metadata=self.metadata, idle_timeout_s=self.idle_timeout_s,
                          created_at=self.at, train=self.train, side_models=self.side_models)


class RewardAdded(Record, tag="reward_added"):
    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = ""
    name: str = "reward"
    value: float = 0.0
    step: int | None = None  # None: trajectory-level
    at: float = msgspec.field(default_factory=time.time)
    source: RewardSource = "http"
    # Given after the session's trajectory went to the stream: recorded and exported, never trained
    late: bool = False
    provenance: Provenance = {}  # what made it, when its giver said (a judge's model, prompt, rubric hash)


class Held(Record, tag="held"):
    """A session finished with its reward pending: its trajectory (steps as refs, like the closing record),
    durable but not on the stream. A ``Trajectory`` record with the same id releases it (the reward arrived,
    or the deadline's default value); a ``HeldDropped`` record ends it untrained."""

    schema_version: int = SCHEMA_VERSION
    trajectory: Trajectory = msgspec.field(default_factory=Trajectory)
    deadline_at: float = 0.0  # unix seconds (a restart keeps the deadline)
    on_deadline: Literal["drop"] | float = "drop"  # at the deadline: drop it, or release it with this reward
    at: float = msgspec.field(default_factory=time.time)


class HeldDropped(Record, tag="held_dropped"):
    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = ""
    reason: str = "deadline"
    at: float = msgspec.field(default_factory=time.time)


class PolicyVersion(Record, tag="policy_version"):
    """The proxy's policy version after a weight swap (persisted so a restart keeps counting): the whole state
    (``weights/policy.py``), so the latest record alone restores it."""

    schema_version: int = SCHEMA_VERSION
    version: int = 0
    path: str | None = None  # the base weights on disk (under a LoRA version too)
    lora_path: str | None = None
    on_disk: bool = True  # whether the base weights served are those at path (not after a transfer)
    at: float = msgspec.field(default_factory=time.time)


CurationAction = Literal["exclude", "include", "reward", "tag"]


class Curation(Record, tag="curation"):
    """A person's (or a rule's, or a script's) mark on a trajectory or one of its steps
    (``POST /sessions/<id>/curation``, the console). Durable in the log; the learner honours the latest
    ``exclude``/``include`` and every ``reward`` edit for what it has not trained yet
    (``middleware/curation.py``)."""

    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = ""
    step: int | None = None  # None: the whole trajectory
    action: CurationAction = "tag"
    value: float | None = None  # action "reward": the reward component's new value
    name: str = "reward"  # action "reward": which component
    tags: list[str] = []  # action "tag"
    reason: str = ""
    by: str = ""  # "console" or "api"
    at: float = msgspec.field(default_factory=time.time)


# A finished trajectory is one ``Trajectory`` record written when its session closes; since v4 it refers to
# its logged steps (``step_refs``) rather than embedding them, so a session's bytes grow with its new tokens
# only.
LogRecord = Step | Trajectory | SessionOpened | RewardAdded | PolicyVersion | Curation | Held | HeldDropped

# The codecs, made once: every module imports these (tests/unit/test_codecs_once.py). msgspec encoders take
# no type, so these two encode everything the proxy writes, records or not.
msgpack_encoder = msgspec.msgpack.Encoder()
json_encoder = msgspec.json.Encoder()
sorted_json_encoder = msgspec.json.Encoder(order="sorted")  # a value's JSON whatever its dicts' key order
log_decoder = msgspec.msgpack.Decoder(LogRecord)
trajectory_msgpack_decoder = msgspec.msgpack.Decoder(Trajectory)
trajectory_json_decoder = msgspec.json.Decoder(Trajectory)
step_msgpack_decoder = msgspec.msgpack.Decoder(Step)
step_json_decoder = msgspec.json.Decoder(Step)
step_versions_decoder = msgspec.msgpack.Decoder(StepVersions)


def to_builtins(record: msgspec.Struct) -> Any:
    """A record as plain dicts/lists (for JSON bodies built by hand)."""
    return msgspec.to_builtins(record)
