"""``Step.sampling`` describes the distribution that produced the tokens (schema v2): what a request sets
beyond temperature and truncation is recorded, a committed v1 log still decodes, and the learner drops (and
counts) the steps whose distribution it cannot reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from steptap.learner.rows import build_batch
from steptap.middleware.config import generation_defaults
from steptap.middleware.delta import steps_of
from steptap.middleware.proxy.capture import sampling_of
from steptap.middleware.records import SCHEMA_VERSION, LogRecord, Sampling, Step, Trajectory

FIXTURE = Path(__file__).parent.parent / "fixtures" / "records-v1.msgpack"


def test_a_v1_log_still_decodes_with_neutral_sampling() -> None:
    records = msgspec.msgpack.Decoder(list[LogRecord]).decode(FIXTURE.read_bytes())
    assert [type(r).__name__ for r in records] == [
        "SessionOpened", "Step", "RewardAdded", "Trajectory", "PolicyVersion"
    ]
    step, traj = records[1], records[3]
    assert isinstance(step, Step) and isinstance(traj, Trajectory)
    assert step.schema_version == 1 and SCHEMA_VERSION > 1
    assert (step.sampling.temperature, step.sampling.top_p, step.sampling.max_tokens) == (0.7, 0.9, 4)
    # fields v1 did not have decode as the neutral values: a v1 request set none of them
    assert step.sampling == Sampling(temperature=0.7, top_p=0.9, max_tokens=4)
    assert traj.steps[0] == step and traj.rewards == {"judge": 1.0}


def test_sampling_records_what_shapes_the_distribution() -> None:
    body = {
        "messages": [], "temperature": 0.5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "min_tokens": 3, "logit_bias": {"7": -100}, "bad_words": ["x"],
        "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
    }
    s = sampling_of(body, forced=False)
    assert (s.temperature, s.min_p, s.presence_penalty, s.frequency_penalty) == (0.5, 0.1, 0.5, -0.5)
    assert (s.repetition_penalty, s.min_tokens, s.logit_bias) == (1.2, 3, {"7": -100.0})
    assert sorted(s.constraints) == ["bad_words", "response_format", "structured_outputs"]
    # a plain text response format and an optional tool choice constrain nothing
    plain = sampling_of({"response_format": {"type": "text"}, "tools": [{}], "tool_choice": "auto"}, False)
    assert plain.constraints == [] and plain == Sampling()
    forced_tool = {"tools": [{"type": "function"}], "tool_choice": {"type": "function",
                                                                    "function": {"name": "f"}}}
    assert sampling_of(forced_tool, False).constraints == ["tool_choice"]


def test_generation_config_defaults_are_recorded(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "min_p": 0.05, "repetition_penalty": 1.1, "eos_token_id": [1, 2]})
    )
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "min_p": 0.05, "repetition_penalty": 1.1}
    s = sampling_of({"messages": []}, False, defaults)
    assert (s.temperature, s.min_p, s.repetition_penalty) == (0.6, 0.05, 1.1)
    assert sampling_of({"min_p": 0.0}, False, defaults).min_p == 0.0  # the request's own value wins


def _traj(sampling: Sampling, i: int) -> Trajectory:
    step = Step(trajectory_id=f"t{i}", prompt_token_ids=[1, 2], response_token_ids=[3],
                response_logprobs=[-0.1],
                sampling=sampling)
    return Trajectory(id=f"t{i}", status="finished", steps=[step], rewards={"r": 1.0})


def test_the_learner_drops_and_counts_unreproducible_steps() -> None:
    kinds = [Sampling(), Sampling(min_p=0.1), Sampling(repetition_penalty=1.1),
             Sampling(presence_penalty=0.2),
             Sampling(frequency_penalty=0.2), Sampling(min_tokens=2), Sampling(logit_bias={"3": 5.0}),
             Sampling(constraints=["structured_outputs"]), Sampling(temperature=0.7)]
    batch = build_batch([_traj(s, i) for i, s in enumerate(kinds)], version=0)
    assert batch.counts["dropped_unreproducible"] == 7
    assert [s.trajectory_id for s in batch.samples] == ["t0", "t8"]
    assert batch.counts["steps"] == len(kinds)


FIXTURE_V2 = Path(__file__).parent.parent / "fixtures" / "records-v2.msgpack"


def test_a_v2_log_still_decodes() -> None:
    """Records written by schema v2 (committed under tests/fixtures), an anonymous call's Step and one-step
    Trajectory among them: every later reader must read them."""
    records = msgspec.msgpack.Decoder(list[LogRecord]).decode(FIXTURE_V2.read_bytes())
    assert [type(r).__name__ for r in records] == [
        "SessionOpened", "Step", "RewardAdded", "Trajectory", "Step", "Trajectory", "PolicyVersion"
    ]
    step, traj, anon_step, anon = records[1], records[3], records[4], records[5]
    assert isinstance(step, Step) and isinstance(traj, Trajectory) and isinstance(anon, Trajectory)
    assert step.schema_version == 2 and traj.schema_version == 2
    assert step.sampling == Sampling(temperature=0.7, min_p=0.05, constraints=["response_format"])
    assert traj.steps == [step] and traj.rewards == {"judge": 1.0}
    assert anon.anonymous and anon.steps == [anon_step]
    # v2 logged every step as a Step record too: read as such, each step is found once
    assert traj.steps_logged and anon.steps_logged
    assert list(steps_of(records)) == [step, anon_step]
    # v3 writes an anonymous call as its Trajectory alone; its step is found there
    alone = Trajectory(id="anon-v3", steps=[anon_step], anonymous=True, status="finished", steps_logged=False)
    again = msgspec.msgpack.Decoder(LogRecord).decode(msgspec.msgpack.encode(alone))
    assert list(steps_of([step, again])) == [step, anon_step] and again.schema_version == SCHEMA_VERSION >= 3
