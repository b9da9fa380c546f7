"""What the proxy changes in the body it sends upstream. ``drop_seed``: no ``seed`` (a backend that dies on
it never sees it), the agent's other keys as they were; without the flag the seed goes as sent.
``max_tokens_cap``: every limit a call names lowered to the cap, a call without one given it."""

from __future__ import annotations

import msgspec
import pytest

from steptap.middleware.config import ProxyConfig
from steptap.middleware.proxy.serving import _upstream_body, forced_sampling, patch_request


def _sent(raw: bytes, **cfg: object) -> dict[str, object]:
    body = msgspec.json.decode(raw)
    config = ProxyConfig(backend="http://127.0.0.1:1", **cfg)
    out, _ = patch_request(body, "chat.completions", "tiny", config, config.force_sampling)
    sent = _upstream_body(raw, body, out)
    assert isinstance(sent, bytes)
    return dict(msgspec.json.decode(sent))


def test_the_seed_is_dropped_only_where_the_backend_dies_on_it() -> None:
    raw = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"seed":7,"temperature":0.5}'
    kept = _sent(raw)
    assert kept["seed"] == 7 and kept["logprobs"] is True
    dropped = _sent(raw, drop_seed=True)
    assert "seed" not in dropped
    assert {k: v for k, v in kept.items() if k != "seed"} == dropped
    # the completions form too (a prompt, logprobs 0), and a body without a seed is untouched
    body = {"prompt": "hi", "seed": 1}
    out, _ = patch_request(body, "completions", "tiny", ProxyConfig(backend="http://x:1", drop_seed=True), {})
    assert out == {"prompt": "hi", "logprobs": 0, "return_token_ids": True}
    assert _sent(b'{"messages":[]}', drop_seed=True) == _sent(b'{"messages":[]}')


def test_max_tokens_cap_lowers_every_limit_a_call_names_and_gives_one_to_a_call_without() -> None:
    raw = b'{"model":"tiny","messages":[],"max_completion_tokens":4096,"max_tokens":10}'
    capped = _sent(raw, max_tokens_cap=64)
    assert (capped["max_completion_tokens"], capped["max_tokens"]) == (64, 10)  # lowered, never raised
    assert _sent(b'{"messages":[]}', max_tokens_cap=64)["max_tokens"] == 64
    assert "max_tokens" not in _sent(b'{"messages":[]}')  # no cap: untouched
    # what is recorded is what vLLM was asked for
    from steptap.middleware.proxy.capture import sampling_of

    assert sampling_of(capped, False).max_tokens == 64
    body = {"prompt": "hi", "max_tokens": 500}
    capped_cfg = ProxyConfig(backend="http://x:1", max_tokens_cap=100)
    out, _ = patch_request(body, "completions", "tiny", capped_cfg, {})
    assert out["max_tokens"] == 100 and body["max_tokens"] == 500  # the agent's body is not changed


def test_a_negative_cap_is_refused_when_the_config_is_read() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_tokens_cap must be 0"):
        ProxyConfig(backend="http://x:1", max_tokens_cap=-1)


def test_an_eval_session_gets_eval_sampling_and_a_train_one_force_sampling() -> None:
    from steptap.middleware.records import Trajectory
    from steptap.middleware.sessions.session import LiveSession

    cfg = ProxyConfig(backend="http://x:1", force_sampling={"temperature": 0.6},
                      eval_sampling={"temperature": 0})
    train, evaluation = (LiveSession(Trajectory(id=m, mode=m), None) for m in ("train", "eval"))
    assert forced_sampling(cfg, train) == {"temperature": 0.6} == forced_sampling(cfg, None)
    assert forced_sampling(cfg, evaluation) == {"temperature": 0}
    out, _ = patch_request({"prompt": "hi", "temperature": 1.0}, "completions", "tiny", cfg,
                           forced_sampling(cfg, evaluation))
    assert out["temperature"] == 0
    unset = ProxyConfig(backend="http://x:1", force_sampling={"temperature": 0.6})  # eval: force_sampling too
    assert forced_sampling(unset, evaluation) == {"temperature": 0.6}


def test_a_bad_eval_sampling_flag_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from steptap.middleware.server.serve import config_from_args

    with pytest.raises(SystemExit):
        config_from_args(["--backend", "http://b", "--eval-sampling", "temperature=greedy"])
    assert "--eval-sampling: temperature must be a number, got 'greedy'" in capsys.readouterr().err
    assert config_from_args(["--backend", "http://b", "--eval-sampling", "temperature=0"]).eval_sampling == {
        "temperature": 0.0}


def test_the_agents_own_bytes_go_upstream_when_only_keys_were_added() -> None:
    """Token ids and logprobs turned on are appended to the agent's bytes (its history is not encoded
    again); a value set equal to the agent's keeps them too; a changed or dropped one re-encodes the body."""
    raw = b'{"model": "tiny",  "messages": [{"role": "user", "content": "hi"}], "temperature": 0.6}'
    body = msgspec.json.decode(raw)
    forced = {"temperature": 0.6}
    config = ProxyConfig(backend="http://127.0.0.1:1")
    out, _ = patch_request(body, "chat.completions", "tiny", config, forced)
    sent = _upstream_body(raw, body, out)
    assert isinstance(sent, bytes) and sent.startswith(raw[:-1])  # the agent's spacing kept: not re-encoded
    assert msgspec.json.decode(sent) == {**body, "logprobs": True, "return_token_ids": True}
    assert list(msgspec.json.decode(sent))[-2:] == ["logprobs", "return_token_ids"]
    for forced, cfg in (({"temperature": 0.2}, {}), ({}, {"drop_seed": True})):
        with_seed = {**body, "seed": 3}
        out, _ = patch_request(with_seed, "chat.completions", "tiny", ProxyConfig(backend="http://127.0.0.1:1",
                                                                                   **cfg), forced)
        sent = _upstream_body(msgspec.json.encode(with_seed), with_seed, out)
        assert isinstance(sent, bytes) and msgspec.json.decode(sent) == out  # encoded from what changed
