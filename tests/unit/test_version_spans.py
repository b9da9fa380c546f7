"""Steps whose generation spans a weight swap (schema v4, ``Step.version_spans``): each response token carries
the version that sampled it; a committed v3 log still decodes (one span); the learner's staleness is per
token, in the rows of both engines (the torch engine's layout and verl's rows)."""

from __future__ import annotations

import types
from pathlib import Path

import msgspec
import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.engines.verl_engine import VerlEngine
from steptap.learner.rows import build_batch
from steptap.middleware.delta import steps_of
from steptap.middleware.records import SCHEMA_VERSION, LogRecord, Step, Trajectory, token_versions

FIXTURE_V3 = Path(__file__).parent.parent / "fixtures" / "records-v3.msgpack"


def test_a_v3_log_decodes_as_one_span_per_step() -> None:
    records = msgspec.msgpack.Decoder(list[LogRecord]).decode(FIXTURE_V3.read_bytes())
    assert [type(r).__name__ for r in records] == [
        "SessionOpened", "Step", "RewardAdded", "Trajectory", "Trajectory", "PolicyVersion"]
    step, anon = records[1], records[4]
    assert isinstance(step, Step) and isinstance(anon, Trajectory)
    assert step.schema_version == 3 and SCHEMA_VERSION >= 4
    assert step.version_spans == [] and step.token_versions() == [2, 2, 2, 2]
    assert [s.token_versions() for s in steps_of(records)] == [[2, 2, 2, 2], [2]]


def test_token_versions_from_spans() -> None:
    assert token_versions([], 3, 2) == [3, 3]
    assert token_versions([[0, 1], [2, 2]], 1, 5) == [1, 1, 2, 2, 2]
    assert token_versions([[0, 1], [2, 2], [3, 3]], 1, 5) == [1, 1, 2, 3, 3]
    assert token_versions([[0, 1], [9, 2]], 1, 3) == [1, 1, 1]  # a span past the end: nothing of it
    step = Step(policy_version=4, response_token_ids=[1, 2, 3], version_spans=[[0, 4], [1, 5]])
    again = msgspec.msgpack.Decoder(LogRecord).decode(msgspec.msgpack.encode(step))
    assert again.token_versions() == [4, 5, 5]


def _spanning(n_old: int = 3, n_new: int = 3) -> Trajectory:
    """One step begun on version 1 whose last ``n_new`` tokens were sampled by version 4."""
    n = n_old + n_new
    step = Step(trajectory_id="t", prompt_token_ids=[1, 2, 3], response_token_ids=list(range(10, 10 + n)),
                response_logprobs=[-0.5] * n, policy_version=1, version_spans=[[0, 1], [n_old, 4]])
    other = Step(trajectory_id="u", prompt_token_ids=[1, 2], response_token_ids=[7, 8],
                 response_logprobs=[-0.5, -0.5], policy_version=5)
    return [Trajectory(id="t", group_id="g", steps=[step], rewards={"r": 1.0}, status="finished"),
            Trajectory(id="u", group_id="g", steps=[other], rewards={"r": 0.0}, status="finished")]


def test_staleness_is_per_token_drop() -> None:
    # learner at 5, max_staleness 2: the 3 tokens of version 1 (lag 4) are stale, those of version 4 are not.
    # Read as one span (the step's policy_version), the whole step would be dropped.
    batch = build_batch(_spanning(), version=5, max_staleness=2, stale_mode="drop")
    assert batch.counts["dropped_stale"] == 0 and batch.counts["spanning_steps"] == 1
    s = batch.samples[0]
    assert s.weights() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert batch.counts["stale_tokens"] == 3
    # every token stale: the step is dropped as before
    batch = build_batch(_spanning(), version=7, max_staleness=2, stale_mode="drop")
    assert batch.counts["dropped_stale"] == 1


def test_staleness_is_per_token_downweight() -> None:
    batch = build_batch(_spanning(), version=5, max_staleness=2, stale_mode="downweight", stale_decay=0.5)
    assert batch.samples[0].weights() == [0.25, 0.25, 0.25, 1.0, 1.0, 1.0]  # 0.5 ** (4 - 2) on version 1's


def _cfg() -> LearnerConfig:
    return LearnerConfig(model_dir="unused", algorithm="grpo")


def test_both_engines_weigh_and_mask_each_token() -> None:
    batch = build_batch(_spanning(), version=5, max_staleness=2, stale_mode="downweight", stale_decay=0.5)
    cfg = _cfg()
    # torch engine: advantages scaled per token
    lay = TorchEngine._layout(types.SimpleNamespace(value_head=None, cfg=cfg),
                              batch)  # type: ignore[arg-type]
    s = batch.samples[0]
    adv = lay.adv[0][s.offset - 1: s.offset - 1 + 6]
    assert adv[0] != 0 and torch.allclose(adv[:3], adv[3:] * 0.25)
    # verl rows: the same advantages
    rows = VerlEngine._rows(types.SimpleNamespace(cfg=cfg,
                                                  pad_id=0), batch)  # type: ignore[arg-type]
    assert torch.allclose(rows["adv"][0][:3], rows["adv"][0][3:] * 0.25)

    dropped = build_batch(_spanning(), version=5, max_staleness=2, stale_mode="drop")
    lay = TorchEngine._layout(types.SimpleNamespace(value_head=None, cfg=cfg),
                              dropped)  # type: ignore[arg-type]
    s = dropped.samples[0]
    assert lay.mask[0][s.offset - 1: s.offset - 1 + 6].tolist() == [False] * 3 + [True] * 3
    rows = VerlEngine._rows(types.SimpleNamespace(cfg=cfg,
                                                  pad_id=0), dropped)  # type: ignore[arg-type]
    assert rows["mask"][0].tolist() == [0.0] * 3 + [1.0] * 3  # out of the loss and of rollout correction


# --- where the split comes from (weights/spans.py) ---------------------------------------------------------


def _wv(*spans: tuple[str, int, int]) -> list[dict[str, object]]:
    return [{"version": v, "start": s, "end": e} for v, s, e in spans]


def test_a_streamed_chat_call_splits_at_the_tokens_relayed_and_a_plain_one_keeps_its_version() -> None:
    from steptap.middleware.weights.spans import Spans

    streamed = Spans(2)
    streamed.counter = lambda: {0: 7}
    streamed.mark(3)
    assert streamed.of(0) == [[0, 2], [7, 3]]
    plain = Spans(2)  # non-streamed chat: no counter, no per-token versions from vLLM
    plain.mark(3)
    assert plain.of(0) == []
    behind = Spans(2)  # streamed, but the pump was held by a slow agent: its count may miss sampled tokens
    behind.counter = lambda: None
    behind.mark(3)
    assert behind.of(0) == []


def test_tito_takes_the_split_from_vllms_weight_versions() -> None:
    from steptap.middleware.weights.spans import Spans

    # Non-streamed generate (no counter): vLLM's labels give the split the proxy could not see.
    spans = Spans(0)
    spans.mark(1)
    spans.report(0, _wv(("default", 0, 12), ("1", 12, 40)))  # an unlabelled server's version 0 is "default"
    assert spans.of(0) == [[0, 0], [12, 1]]
    # Streamed: vLLM's split wins over the relayed count (tokens sampled before the pause but not yet
    # relayed).
    spans = Spans(4)
    spans.counter = lambda: {0: 9, 1: 3}
    spans.mark(5)
    spans.report(0, _wv(("4", 0, 11), ("5", 11, 20)))
    assert spans.of(0) == [[0, 4], [11, 5]]
    assert spans.of(1) == [[0, 4], [3, 5]]  # a choice vLLM said nothing of: the relayed count
    # A label the proxy never marked for this call (a LoRA swap moves it, no weights under the call change):
    # its tokens stay the call's version.
    spans = Spans(4)
    spans.report(0, _wv(("4", 0, 5), ("5", 5, 20)))
    assert spans.of(0) == []
    # Labels not kept in step with the proxy's versions (never labelled, other labels) are not trusted.
    spans = Spans(4)
    spans.mark(5)
    spans.report(0, _wv(("default", 0, 20)))
    spans.report(1, _wv(("v4", 0, 20)))
    assert spans.reported == {}
    # A call on a LoRA adapter: vLLM's label is the base weights', not the adapter's.
    spans = Spans(4, labelled=False)
    spans.mark(5)
    spans.report(0, _wv(("4", 0, 3), ("5", 3, 20)))
    assert spans.reported == {} and spans.of(0) == []


def test_verls_rollout_correction_sees_only_the_fresh_tokens_of_a_spanning_step() -> None:
    """The verl engine's decoupled loss (rollout_is): the importance weights come from the tokens its mask
    keeps, so a spanning step's stale tokens (sampled by a version too old) never weigh in; read as one span,
    they would."""
    from torch.nn.utils.rnn import pad_sequence

    from steptap.learner import algos

    cfg = LearnerConfig(model_dir="unused", algorithm="grpo", rollout_is="sequence", rollout_is_threshold=1e6)
    batch = build_batch(_spanning(), version=5, max_staleness=2, stale_mode="drop")
    rows = VerlEngine._rows(types.SimpleNamespace(cfg=cfg, pad_id=0), batch)  # type: ignore[arg-type]
    # as train_step builds them
    mask = pad_sequence(rows["mask"], batch_first=True).bool()
    behaviour = pad_sequence(rows["recorded"], batch_first=True)
    assert mask[0].tolist() == [False] * 3 + [True] * 3
    # the learner's policy: version 4's tokens as the sampler had them, version 1's far from it
    proximal = behaviour.clone()
    proximal[0, :3] -= 2.0
    weights, _, metrics = algos.rollout_correction(cfg, proximal, behaviour, mask)
    assert weights is not None and torch.allclose(weights[mask], torch.ones(int(mask.sum())))
    assert abs(metrics["rollout_corr/rollout_is_mean"] - 1.0) < 1e-6
    one_span = torch.ones_like(mask) & (behaviour != 0)  # the spans ignored: every response token in the mask
    weights, _, _ = algos.rollout_correction(cfg, proximal, behaviour, one_span)
    assert weights is not None and float(weights[0, 3]) < 0.01  # exp(-6): the stale tokens drag the step down
