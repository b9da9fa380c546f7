"""/app/summary.json against the answer key of the log the task shipped: each of its four values is a named
reward of 0.25 (all four right: 1.0; a missing or unreadable file: 0 for each), written to the reward file
named on the command line."""

import json
import sys

EXPECTED = {
    "requests": 60,
    "status": {"200": 32, "301": 2, "304": 10, "404": 9, "500": 7},
    "top_path": "/favicon.ico",
    "unique_ips": 9,
}


def rewards() -> dict[str, float]:
    try:
        with open("/app/summary.json", encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"no summary: {exc!r}")
        summary = None
    if not isinstance(summary, dict) or set(summary) != set(EXPECTED):
        print(f"not an object with exactly the keys {sorted(EXPECTED)}")
        return {key: 0.0 for key in EXPECTED}
    out = {}
    for key, want in EXPECTED.items():
        got = summary[key]
        # type(got) is type(want): 60.0 or true is not the integer asked for
        right = type(got) is type(want) and got == want
        print(f"{'passed' if right else 'FAILED'} {key}: {got!r}")
        out[key] = 0.25 if right else 0.0
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(rewards(), f)
