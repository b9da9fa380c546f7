"""/app/summary.json against the answer key of the log the task shipped: each of its four values is a named
reward of 0.25 (all four right: 1.0; a missing or unreadable file: 0 for each), written to the reward file
named on the command line."""

import json
import os
import stat
import sys

EXPECTED = {
    "requests": 60,
    "status": {"200": 32, "301": 2, "304": 10, "404": 9, "500": 7},
    "top_path": "/favicon.ico",
    "unique_ips": 9,
}

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def rewards() -> dict[str, float]:
    try:
        summary = json.loads(_read("/app/summary.json"))
    except (OSError, ValueError, AssertionError) as exc:
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
