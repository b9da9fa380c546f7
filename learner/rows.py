"""Trajectories -> training rows.

One *sample* per trained step: its prompt and response ids, the recorded vLLM logprobs (the behaviour
policy), its return and group. Samples are laid out in *sequences*: a step whose ``prefix`` is ``extends``
(its prompt is the previous step's prompt + response + new tokens, token for token) is packed with its
predecessor, so a chain of k steps costs one forward pass over the last step's prompt + response instead of k.
In a packed sequence every step's response tokens are in the loss and everything else (system prompt, tool
results, the tokens re-fed between steps) is masked.
A sample holds no prompt of its own: it is an offset into its sequence (``Batch.prompt_ids``). Steps may
come full or as logged (delta steps, the client's ``full=False``): they are expanded one at a time, so a long
session costs the rows its context once, not once a step.

Vision steps (``Step.images``): a step that showed the model images is a sample carrying its image refs and a
sequence of its own, never packed (Qwen2-VL's M-RoPE position ids are computed per sequence from the image
grids); ``vision`` (learner/vision.py) turns it into model inputs (``Sequence.vision``) or names why it is
dropped: images the resolver cannot give, a processor whose grids disagree with the prompt's pad tokens, or a
policy without a vision tower. Such a step is never trained as text.

Nothing is dropped silently: every skipped trajectory or step and every chain break is counted by cause in
``Batch.counts``, and the response tokens each cause kept out of the loss in ``Batch.tokens`` (the run's
health, learner/health.py). Only ``train`` trajectories train: ``eval`` and ``judge`` ones are counted
(``dropped_eval``, ``dropped_judge``).

Side calls (``Step.call_class == "side"``: a title, a small-fast-model call, a summary beside the main line,
sessions/classify.py) train only in a session opened with ``train: "all"``; by default they are dropped
(``dropped_side``). Either way they never break the main line's chain: a side call between two turns leaves
them packed as one sequence, and a trained side call is a sequence of its own. A ``branch`` step (a
compaction's new history) trains as the main line does and starts a new sequence.

Returns and step rewards (what each trained step is credited with) and per-token staleness weights:
learner/credit.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from steptap.learner.credit import stale_weights, step_returns, step_rewards
from steptap.middleware.curation import CurationState, edit_rewards
from steptap.middleware.delta import DeltaError, Expander
from steptap.middleware.records import ImageRef, Sampling, Step, Trajectory

# step -> its model inputs (pixel_values, image_grid_thw) or the cause it is dropped for (learner/vision.py)
VisionFn = Callable[[Step], "dict[str, Any] | str"]
IMAGES_UNSUPPORTED = "dropped_image_text_model"  # a step with images and no vision preparer (a text policy)


@dataclass(slots=True)
class Sample:
    """One trained step. ``offset`` is where its response starts inside its sequence: its prompt is the
    sequence's ids before it (``Batch.prompt_ids``), not a copy (a chain of n steps would hold n prompts)."""

    trajectory_id: str
    group: str  # the advantage estimator's group index (group_id, or the trajectory id when none)
    step_index: int
    response_ids: list[int]
    logprobs: list[float]  # recorded by vLLM: raw (before temperature / truncation), one per response token
    temperature: float
    top_p: float
    top_k: int
    policy_version: int
    ret: float  # the step's return (learner/credit.py)
    reward: float = 0.0  # the step's own reward (learner/credit.py): GAE's r_k
    weight: float = 1.0  # < 1: a stale step kept with stale_mode="downweight"
    seq: int = -1
    offset: int = 0
    # Per response token, when a step's tokens came from several policy versions (a generation that spanned a
    # weight swap): staleness is each token's own. 0 = a stale token out of the loss (stale_mode="drop").
    token_weights: list[float] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)  # the images its prompt showed, in prompt order

    def weights(self) -> list[float]:
        """The staleness weight of each response token."""
        return self.token_weights or [self.weight] * len(self.response_ids)

    @property
    def truncated(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


@dataclass(slots=True)
class Sequence:
    """One forward pass: ``input_ids`` = the last packed step's prompt + response."""

    input_ids: list[int]
    samples: list[int] = field(default_factory=list)  # indices into Batch.samples
    vision: dict[str, Any] | None = None  # a vision step's image inputs (pixel_values, image_grid_thw)


@dataclass(slots=True)
class Batch:
    samples: list[Sample] = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)  # scalar reward of each trained trajectory
    trajectory_ids: list[str] = field(default_factory=list)  # every trajectory consumed (trained or dropped)
    version: int = 0  # the learner's policy version the batch was built at
    # Response tokens of train trajectories: "generated" (all), "trained" (in the loss), and each drop cause's
    tokens: Counter = field(default_factory=Counter)
    replies: int = 0  # steps of train trajectories (model replies)
    cut: Counter = field(default_factory=Counter)  # replies cut by max_tokens (finish_reason "length"), by it
    unrewarded: int = 0  # trained trajectories no reward reached at all (none given, on it or its steps)

    @property
    def has_vision(self) -> bool:
        return any(s.vision is not None for s in self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.sequences)

    def prompt_ids(self, i: int) -> list[int]:
        """Sample ``i``'s prompt: its sequence's ids before its response (a copy)."""
        s = self.samples[i]
        return self.sequences[s.seq].input_ids[: s.offset]


def reproducible(sampling: Sampling) -> bool:
    """Whether the learner can recompute the distribution the tokens were drawn from: temperature and top-p /
    top-k truncation it handles (scaling, rollout correction); min_p, penalties (which depend on the tokens so
    far), logit bias, a minimum length (EOS masked) and grammar-like constraints it does not, so such steps
    are dropped and counted (``dropped_unreproducible``) rather than trained on with a wrong behaviour
    policy."""
    return (
        sampling.min_p == 0.0
        and sampling.presence_penalty == 0.0
        and sampling.frequency_penalty == 0.0
        and sampling.repetition_penalty == 1.0
        and sampling.min_tokens == 0
        and not sampling.logit_bias
        and not sampling.constraints
    )


def _skip_reason(step: Step, lag: int, max_staleness: int, stale_mode: str,
                 truncation_mode: str) -> str | None:
    if step.status != "ok":
        return "dropped_failed"
    if not step.response_token_ids:
        return "dropped_empty"
    if len(step.response_logprobs) != len(step.response_token_ids):
        return "dropped_bad_logprobs"
    if step.sampling.temperature <= 0:  # greedy decoding: no sampling distribution to learn from
        return "dropped_greedy"
    if not reproducible(step.sampling):
        return "dropped_unreproducible"
    if max_staleness >= 0 and lag > max_staleness and stale_mode == "drop":
        return "dropped_stale"
    if (step.sampling.top_p < 1.0 or step.sampling.top_k > 0) and truncation_mode == "drop":
        return "dropped_truncated"
    return None


@dataclass(frozen=True, slots=True)
class _Options:
    """``build_batch``'s options, handed down to each trajectory's steps as one value."""

    version: int
    gamma: float
    max_staleness: int
    stale_mode: str
    stale_decay: float
    truncation_mode: str
    pack_extends: bool
    vision: VisionFn | None


def build_batch(
    trajectories: list[Trajectory],
    *,
    version: int,
    gamma: float = 1.0,
    max_staleness: int = -1,
    stale_mode: str = "drop",
    stale_decay: float = 0.5,
    truncation_mode: str = "correct",
    pack_extends: bool = True,
    train_aborted: bool = False,
    curation: dict[str, CurationState] | None = None,
    vision: VisionFn | None = None,
    dropped: Iterable[tuple[Trajectory, str]] = (),
) -> Batch:
    """Turn finished trajectories into samples and packed sequences; ``version`` is the learner's current
    policy version. Staleness is per token (lag = version - the version that sampled it,
    ``Step.version_spans``): a step is dropped as stale only when its newest token is. ``curation``: each
    trajectory's marks (middleware/curation.py): excluded trajectories and steps are dropped and counted,
    edited rewards replace the recorded ones. ``vision``: image steps' inputs (module docstring); None: the
    policy has no vision tower and image steps are dropped. ``dropped``: trajectories consumed but never
    trained, with why (anonymous ones, a timed-out group too small: the grouper counted them); only their
    tokens are counted here."""
    opts = _Options(version, gamma, max_staleness, stale_mode, stale_decay, truncation_mode, pack_extends,
                    vision)
    batch = Batch(version=version)
    for traj, cause in dropped:  # consumed, never trained (anonymous, a too-small group): the grouper counted
        batch.trajectory_ids.append(traj.id)
        if traj.mode == "train":
            _replies(batch, traj)
            _untrained(batch, traj, cause)
    for traj in trajectories:
        batch.trajectory_ids.append(traj.id)
        marks = _admitted(batch, traj, curation, train_aborted)
        if marks is not None:
            _add_trajectory(batch, traj, marks, opts)
    batch.tokens["generated"] += 0  # present, so a batch of nothing says 0
    return batch


def _admitted(batch: Batch, traj: Trajectory, curation: dict[str, CurationState] | None,
              train_aborted: bool) -> CurationState | None:
    """A trajectory counted; its curation marks when it may train, else None (why counted by cause)."""
    c = batch.counts
    c["trajectories"] += 1
    if traj.mode != "train":
        c[f"dropped_{traj.mode}"] += 1
        return None
    _replies(batch, traj)
    if traj.status != "finished" and not (train_aborted and traj.status in ("aborted", "timed_out")):
        c[f"dropped_{traj.status}"] += 1
        if traj.status == "infra_error":  # never trained, whatever the options: counted by its cause
            c[f"infra_error_{traj.infra_cause or 'other'}"] += 1
        _untrained(batch, traj, f"dropped_{traj.status}")
        return None
    marks = (curation or {}).get(traj.id) or CurationState()
    if marks.excluded:
        c["dropped_curated"] += 1
        _untrained(batch, traj, "dropped_curated")
        return None
    return marks


def _add_trajectory(batch: Batch, traj: Trajectory, marks: CurationState, opts: _Options) -> None:
    """An admitted trajectory's steps into the batch. A damaged one (a delta without its base) is dropped
    whole: what its steps had added (samples, sequences, counts, tokens) is taken back, then it is counted."""
    c = batch.counts
    if marks.rewards or marks.step_rewards:
        c["curated_reward_edits"] += 1
        traj = edit_rewards(traj, marks)
    before = (len(batch.samples), len(batch.sequences), Counter(c), Counter(batch.tokens))
    try:
        _add_steps(batch, traj, marks, opts)
    except DeltaError:
        del batch.samples[before[0]:], batch.sequences[before[1]:]
        c.clear()
        c.update(before[2])
        c["dropped_unresolvable"] += 1
        batch.tokens.clear()
        batch.tokens.update(before[3])
        _untrained(batch, traj, "dropped_unresolvable")


def _add_steps(batch: Batch, traj: Trajectory, marks: CurationState, opts: _Options) -> None:
    """Each step trained (a sample, packed onto the main line's previous one when it extends it) or dropped
    and counted. Steps as given: full, or as logged (the client's full=False), expanded one at a time holding
    the latest call's in full, so a long session costs the rows its context once, not once a step."""
    c = batch.counts
    steps = sorted(traj.steps, key=lambda s: (s.index, s.choice))
    reward = traj.reward
    expander = Expander()
    rets = step_returns(steps, reward, opts.gamma)
    rewards = step_rewards(steps, reward)
    prev_kept: Sample | None = None  # the main line's last trained step: the next may pack onto it
    last_kept: tuple[Sample, int] | None = None  # (sample, step position): where a dropped step's reward goes
    trained_any = False
    for pos, (logged, ret) in enumerate(zip(steps, rets, strict=False)):
        c["steps"] += 1
        step = expander.full(logged)
        versions = step.token_versions()
        lag = opts.version - max(versions, default=step.policy_version)  # the freshest token's
        side = step.call_class == "side"  # beside the main line (sessions/classify.py): never in its chain
        reason, inputs = _verdict(step, traj, marks, lag, opts)
        if reason:
            c[reason] += 1
            batch.tokens[reason] += len(step.response_token_ids)
            if last_kept is not None:  # its reward is credited to the closest trained step before it
                last_kept[0].reward += opts.gamma ** (pos - last_kept[1]) * rewards[pos]
            if not side:
                prev_kept = None  # a dropped step breaks the chain: the next one starts a sequence
            continue
        sample = _sample(batch, traj, step, ret, rewards[pos], versions, lag, opts)
        if inputs is not None:  # a sequence of its own, and none packs onto it
            _place_alone(batch, sample, step, inputs)
        else:
            _place(batch, sample, None if side else prev_kept, step, opts.pack_extends)
        last_kept = (sample, pos)
        if side:  # a sequence of its own; the main line's chain goes on past it
            c["trained_side_steps"] += 1
        else:  # a vision step ends the chain: the next step starts a sequence
            prev_kept = sample if inputs is None else None
        trained_any = True
        c["trained_steps"] += 1
    if trained_any:
        batch.rewards.append(reward)
        c["trained_trajectories"] += 1
        batch.unrewarded += not traj.rewards and not any(s.rewards for s in steps)


def _verdict(step: Step, traj: Trajectory, marks: CurationState, lag: int,
             opts: _Options) -> tuple[str | None, dict[str, Any] | None]:
    """Why ``step`` (full) is dropped, None when it trains; and a vision step's model inputs."""
    if step.call_class == "side" and traj.train == "main":
        return "dropped_side", None
    if step.index in marks.excluded_steps:
        return "dropped_curated_step", None
    reason = _skip_reason(step, lag, opts.max_staleness, opts.stale_mode, opts.truncation_mode)
    if reason or not step.images:
        return reason, None
    got = opts.vision(step) if opts.vision is not None else IMAGES_UNSUPPORTED
    return (got, None) if isinstance(got, str) else (None, got)


def _sample(batch: Batch, traj: Trajectory, step: Step, ret: float, reward: float, versions: list[int],
            lag: int, opts: _Options) -> Sample:
    """A trained step's sample, weighted by its tokens' staleness; its tokens counted (in the loss, or stale
    out of it)."""
    c = batch.counts
    sample = Sample(
        trajectory_id=traj.id,
        group=traj.group_id or traj.id,
        step_index=step.index,
        response_ids=list(step.response_token_ids),
        logprobs=list(step.response_logprobs),
        temperature=step.sampling.temperature,
        top_p=step.sampling.top_p,
        top_k=step.sampling.top_k,
        policy_version=step.policy_version,
        ret=ret,
        reward=reward,
        images=list(step.images),
    )
    weights = stale_weights(versions, opts.version, opts.max_staleness, opts.stale_mode, opts.stale_decay)
    kept = sum(w > 0 for w in weights)
    batch.tokens["trained"] += kept
    if kept < len(weights):  # tokens of a newer version kept, older ones out (stale_mode drop)
        batch.tokens["dropped_stale"] += len(weights) - kept
    if len(set(versions)) > 1:  # tokens of several versions: weights per token
        c["spanning_steps"] += 1
        if any(w < 1.0 for w in weights):
            sample.token_weights = weights
            c["stale_tokens"] += sum(w < 1.0 for w in weights)
        sample.weight = max(weights)
    elif opts.max_staleness >= 0 and lag > opts.max_staleness:  # stale_mode == "downweight"
        sample.weight = opts.stale_decay ** (lag - opts.max_staleness)
        c["downweighted_stale"] += 1
    if sample.truncated:
        c["kept_truncated"] += 1
    return sample


def _untrained(batch: Batch, traj: Trajectory, cause: str) -> None:
    """A train trajectory none of whose tokens trains: its response tokens counted under ``cause``."""
    batch.tokens[cause] += sum(len(s.response_token_ids) for s in traj.steps)


def _replies(batch: Batch, traj: Trajectory) -> None:
    """A train trajectory's replies and generated tokens, and those cut by ``max_tokens`` (by its value)."""
    for s in traj.steps:
        batch.replies += 1
        batch.tokens["generated"] += len(s.response_token_ids)
        if s.finish_reason == "length":
            batch.cut[s.sampling.max_tokens or 0] += 1


def _place_alone(batch: Batch, sample: Sample, step: Step, inputs: dict[str, Any]) -> None:
    """A vision step's sample in a sequence of its own, with its image inputs (M-RoPE positions are per
    sequence, from its own image grids)."""
    sample.seq, sample.offset = len(batch.sequences), len(step.prompt_token_ids)
    batch.samples.append(sample)
    batch.sequences.append(Sequence(input_ids=list(step.prompt_token_ids) + list(step.response_token_ids),
                                    samples=[len(batch.samples) - 1], vision=inputs))
    batch.counts["vision_steps"] += 1


def _place(batch: Batch, sample: Sample, prev: Sample | None, step: Step, pack_extends: bool) -> None:
    """Append ``sample`` (of ``step``, full) to its predecessor's sequence when it extends it token for token,
    else open one. The sequence's ids grow in place: the chain's tokens are held once."""
    idx = len(batch.samples)
    batch.samples.append(sample)
    prompt = step.prompt_token_ids
    if prev is not None:
        seq = batch.sequences[prev.seq]
        n = len(seq.input_ids)
        packable = (pack_extends and step.prefix == "extends" and len(prompt) >= n
                    and prompt[:n] == seq.input_ids)
        if packable:
            sample.seq, sample.offset = prev.seq, len(prompt)
            seq.input_ids += prompt[n:]
            seq.input_ids += step.response_token_ids
            seq.samples.append(idx)
            batch.counts["packed_steps"] += 1
            return
        # Not merged: count why (the proxy's cause, or a claimed `extends` whose tokens disagree).
        cause = step.prefix if step.prefix != "extends" else ("unpacked" if not pack_extends else "mismatch")
        batch.counts[f"break_{cause}"] += 1
    sample.seq, sample.offset = len(batch.sequences), len(prompt)
    batch.sequences.append(Sequence(input_ids=list(prompt) + list(step.response_token_ids), samples=[idx]))
