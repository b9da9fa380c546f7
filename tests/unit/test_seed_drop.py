"""``drop_seed``: the body sent upstream carries no ``seed`` (a backend that dies on it never sees it), the
agent's other keys as they were; without the flag the seed goes as sent."""

from __future__ import annotations

import msgspec

from steptap.middleware.config import ProxyConfig
from steptap.middleware.proxy.serving import _upstream_body, patch_request


def _sent(raw: bytes, **cfg: object) -> dict[str, object]:
    body = msgspec.json.decode(raw)
    out, _ = patch_request(body, "chat.completions", "tiny", ProxyConfig(backend="http://127.0.0.1:1", **cfg))
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
    out, _ = patch_request(body, "completions", "tiny", ProxyConfig(backend="http://x:1", drop_seed=True))
    assert out == {"prompt": "hi", "logprobs": 0, "return_token_ids": True}
    assert _sent(b'{"messages":[]}', drop_seed=True) == _sent(b'{"messages":[]}')
