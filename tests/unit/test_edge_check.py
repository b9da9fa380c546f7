"""The edge check of a chat body's ``messages`` (proxy/validate.py): a list of objects, else a 400 in
OpenAI's format naming the field; anything else about a message is checked later, by its own rules."""

from __future__ import annotations

import pytest

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.validate import check_model_call


@pytest.mark.parametrize("messages", ["hi", {"role": "user"}, [{"role": "user", "content": "a"}, "b"], [None],
                                      [[]], 7])
def test_messages_that_are_not_a_list_of_objects_are_a_400(messages: object) -> None:
    with pytest.raises(ApiError) as err:
        check_model_call({"model": "m", "messages": messages}, True, 8)
    assert err.value.status == 400 and b"`messages` must be a list of objects" in (err.value.body or b"")


@pytest.mark.parametrize("messages", [[], [{"role": "user", "content": "a"}, {"role": "assistant"}]])
def test_a_list_of_objects_passes(messages: list[object]) -> None:
    view = check_model_call({"model": "m", "messages": messages}, True, 8)
    assert view.model == "m"


# The sampling ranges: one sum decides that every value is finite, the names are read only when it is not, so
# each way a sum can mislead (inf - inf, nan, a finite overflow) is here
@pytest.mark.parametrize(("body", "message"), [
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"top_p": float("nan")}, "top_p must be a finite number, got nan"),
    ({"presence_penalty": float("-inf"), "frequency_penalty": float("inf")},
     "presence_penalty must be a finite number, got -inf"),
    ({"temperature": 0.0, "repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"logit_bias": {"5": 1.0, "7": float("-inf")}}, "logit_bias values must be finite numbers"),
    ({"max_tokens": 3, "min_tokens": -1}, "min_tokens must not be negative, got -1"),
    ({"max_completion_tokens": -2}, "max_completion_tokens must not be negative, got -2"),
])
def test_a_sampling_value_out_of_range_is_a_400_naming_it(body: dict[str, object], message: str) -> None:
    with pytest.raises(ApiError) as err:
        check_model_call({"model": "m", "messages": [], **body}, True, 8)
    assert err.value.status == 400 and message.encode() in (err.value.body or b"")


@pytest.mark.parametrize("body", [
    {"temperature": 1e308, "top_p": 1e308, "min_p": 1e308},  # their sum overflows; each is finite
    {"logit_bias": {"1": 1e308, "2": 1e308}},
    {"temperature": 0, "min_tokens": 0, "max_tokens": 0, "logit_bias": {}},
])
def test_finite_sampling_values_pass_even_when_their_sum_overflows(body: dict[str, object]) -> None:
    check_model_call({"model": "m", "messages": [], **body}, True, 8)
