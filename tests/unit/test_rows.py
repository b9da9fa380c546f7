"""rows.build_batch: samples, masks and packing from hand-built records; every drop and break counted."""

from __future__ import annotations

import pytest

from steptap.learner.rows import build_batch, step_returns
from steptap.middleware.records import Sampling, Step, Trajectory


def _step(index: int, prompt: list[int], response: list[int], *, prefix: str = "first", version: int = 0,
          status: str = "ok", rewards: dict | None = None, **sampling) -> Step:
    return Step(trajectory_id="t", index=index, prompt_token_ids=prompt, response_token_ids=response,
                response_logprobs=[-0.5 - 0.1 * i for i in range(len(response))], prefix=prefix,
                policy_version=version, status=status, rewards=rewards or {}, sampling=Sampling(**sampling))


def _traj(tid: str, steps: list[Step], reward: float = 1.0, **kw) -> Trajectory:
    kw.setdefault("status", "finished")
    return Trajectory(id=tid, group_id=kw.pop("group_id", "g"), steps=steps, rewards={"r": reward}, **kw)


def _chain() -> list[Step]:
    """Three steps: 2 extends 1 (prompt = p1 + r1 + tool tokens), 3 extends 2."""
    p1, r1 = [1, 2, 3], [10, 11]
    p2 = p1 + r1 + [4, 5]
    r2 = [12]
    p3 = p2 + r2 + [6]
    r3 = [13, 14, 15]
    return [_step(0, p1, r1), _step(1, p2, r2, prefix="extends"), _step(2, p3, r3, prefix="extends")]


def test_extends_chain_packs_into_one_sequence_with_only_responses_in_the_loss() -> None:
    batch = build_batch([_traj("a", _chain())], version=0)
    assert len(batch.sequences) == 1 and len(batch.samples) == 3
    seq = batch.sequences[0]
    assert seq.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15]
    in_loss = set()
    for i in seq.samples:
        s = batch.samples[i]
        assert seq.input_ids[s.offset:s.offset + len(s.response_ids)] == s.response_ids
        in_loss |= set(range(s.offset, s.offset + len(s.response_ids)))
    # response tokens only: 10 11 | 12 | 13 14 15; prompt and the re-fed tool tokens 4 5 6 stay masked
    assert sorted(seq.input_ids[i] for i in in_loss) == [10, 11, 12, 13, 14, 15]
    assert batch.counts["packed_steps"] == 2 and batch.counts["trained_steps"] == 3
    assert batch.num_tokens == 12  # one forward over 12 tokens instead of 5 + 8 + 12


def test_breaks_are_counted_by_cause_and_start_new_sequences() -> None:
    steps = _chain()
    steps[1] = _step(1, [9, 9, 9], [12], prefix="history_edited")
    steps[2] = _step(2, [1, 2, 3, 99], [13], prefix="extends")  # claims extends, tokens disagree
    batch = build_batch([_traj("a", steps)], version=0)
    assert len(batch.sequences) == 3
    assert batch.counts["break_history_edited"] == 1
    assert batch.counts["break_mismatch"] == 1
    assert batch.counts["packed_steps"] == 0
    unpacked = build_batch([_traj("a", _chain())], version=0, pack_extends=False)
    assert len(unpacked.sequences) == 3 and unpacked.counts["break_unpacked"] == 2


def test_failed_steps_are_skipped_and_break_the_chain() -> None:
    steps = _chain()
    steps[1] = Step(trajectory_id="t", index=1, prompt_token_ids=steps[1].prompt_token_ids, status="failed",
                    prefix="extends")
    batch = build_batch([_traj("a", steps)], version=0)
    assert batch.counts["dropped_failed"] == 1
    assert [s.step_index for s in batch.samples] == [0, 2]
    assert len(batch.sequences) == 2  # step 2 cannot join step 0's sequence: its predecessor is gone


def test_eval_and_unfinished_trajectories_are_not_trained_on() -> None:
    trajs = [
        _traj("e", _chain(), mode="eval"),
        _traj("x", _chain(), status="aborted"),
        _traj("t", _chain(), status="timed_out"),
        _traj("ok", _chain()),
    ]
    batch = build_batch(trajs, version=0)
    c = batch.counts
    assert (c["dropped_eval"], c["dropped_aborted"], c["dropped_timed_out"]) == (1, 1, 1)
    assert {s.trajectory_id for s in batch.samples} == {"ok"}
    assert batch.trajectory_ids == ["e", "x", "t", "ok"]  # all consumed (so all acknowledged)
    assert batch.rewards == [1.0]
    with_aborted = build_batch(trajs, version=0, train_aborted=True)
    assert {s.trajectory_id for s in with_aborted.samples} == {"x", "t", "ok"}


def test_truncated_sampling_dropped_or_kept_and_counted() -> None:
    steps = [_step(0, [1, 2], [3, 4], top_p=0.9), _step(1, [5], [6], top_k=20), _step(2, [7], [8])]
    dropped = build_batch([_traj("a", steps)], version=0, truncation_mode="drop")
    assert dropped.counts["dropped_truncated"] == 2 and len(dropped.samples) == 1
    kept = build_batch([_traj("a", steps)], version=0, truncation_mode="correct")
    assert kept.counts["kept_truncated"] == 2 and len(kept.samples) == 3
    assert [s.truncated for s in kept.samples] == [True, True, False]


def test_temperature_is_carried_and_greedy_steps_dropped() -> None:
    steps = [_step(0, [1], [2], temperature=0.7), _step(1, [3], [4], temperature=0.0)]
    batch = build_batch([_traj("a", steps)], version=0)
    assert [s.temperature for s in batch.samples] == [0.7]
    assert batch.counts["dropped_greedy"] == 1


def test_staleness_drop_and_downweight_are_counted() -> None:
    steps = [_step(0, [1], [2], version=0), _step(1, [3], [4], version=3), _step(2, [5], [6], version=5)]
    dropped = build_batch([_traj("a", steps)], version=5, max_staleness=2, stale_mode="drop")
    assert dropped.counts["dropped_stale"] == 1  # lag 5 > 2; lags 2 and 0 kept
    assert [s.policy_version for s in dropped.samples] == [3, 5]
    down = build_batch([_traj("a", steps)], version=5, max_staleness=2, stale_mode="downweight",
                       stale_decay=0.5)
    assert down.counts["downweighted_stale"] == 1
    assert [s.weight for s in down.samples] == [0.5 ** 3, 1.0, 1.0]
    off = build_batch([_traj("a", steps)], version=5, max_staleness=-1)
    assert len(off.samples) == 3 and off.counts["dropped_stale"] == 0


def test_bad_logprobs_are_dropped() -> None:
    s = _step(0, [1], [2, 3])
    s.response_logprobs = [-1.0]
    batch = build_batch([_traj("a", [s])], version=0)
    assert batch.counts["dropped_bad_logprobs"] == 1 and not batch.samples


def test_step_returns_discount_process_rewards_and_add_the_trajectory_reward() -> None:
    steps = [_step(0, [1], [2], rewards={"a": 1.0}), _step(1, [3], [4]),
             _step(2, [5], [6], rewards={"b": 2.0})]
    g = 0.5
    # return_k = sum_{j>=k} g^(j-k) r_j + g^(n-1-k) R, R = 4
    assert step_returns(steps, 4.0, g) == pytest.approx([1 + g * 0 + g**2 * 2 + g**2 * 4, 0 + g * 2 + g * 4,
                                                         2 + 4])
    batch = build_batch([_traj("a", steps, reward=4.0)], version=0, gamma=g)
    assert [s.ret for s in batch.samples] == pytest.approx(step_returns(steps, 4.0, g))
    flat = build_batch([_traj("a", steps[1:2], reward=3.0)], version=0)
    assert flat.samples[0].ret == 3.0  # no process rewards: the trajectory reward reaches the step


def test_group_index_is_group_id_or_the_trajectory() -> None:
    batch = build_batch([_traj("a", _chain()[:1], group_id="g1"), _traj("b", _chain()[:1], group_id=None)],
                        version=0)
    assert [s.group for s in batch.samples] == ["g1", "b"]
