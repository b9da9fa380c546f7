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
