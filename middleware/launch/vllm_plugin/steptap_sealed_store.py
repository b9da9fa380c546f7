"""A torch.distributed store only holders of one transfer's secret can use (learner and vLLM workers alike).

torch's TCPStore has no authentication: whoever reaches its port may list every key (``list_keys``), read and
write them. A collective transfer's rendezvous goes through it (the group's size, each rank's address, NCCL's
unique id), so this wrapper seals it with a per-transfer random secret the learner hands to vLLM only inside
the authenticated ``POST /admin/weights`` body: key names are HMACs of the real names (nothing to read off
``list_keys``, nothing to guess), values are encrypted (a SHAKE-256 keystream under a fresh nonce) and carry
an HMAC bound to their key, so a value a stranger wrote or moved fails to open instead of being believed. A
stranger can still delete or spoil keys (the transfer then fails and says so), never join or read.

Torch only and stdlib: it runs in vLLM's venv (the plugin) and in the learner (``steptap.learner.transfer``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os

import torch.distributed as dist

NONCE = 16
TAG = 32
MIN_SECRET_CHARS = 32


class SealedStoreError(RuntimeError):
    """A value that was not written by a holder of the secret (a stranger's, or torn)."""


class SealedStore(dist.Store):
    """``inner`` (a TCPStore) seen through ``secret``: see the module's docstring."""

    def __init__(self, inner: dist.Store, secret: str) -> None:
        super().__init__()
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"a transfer secret has at least {MIN_SECRET_CHARS} characters")
        self._inner = inner
        self._key = hashlib.sha256(b"steptap-transfer\0" + secret.encode()).digest()

    def _name(self, key: str) -> str:
        return "k/" + hmac.new(self._key, b"name\0" + key.encode(), "sha256").hexdigest()

    def _stream(self, nonce: bytes, n: int) -> bytes:
        return hashlib.shake_256(self._key + b"stream\0" + nonce).digest(n)

    def _tag(self, name: str, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"\0" + nonce + body, "sha256").digest()

    def seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(NONCE)
        body = bytes(a ^ b for a, b in zip(value, self._stream(nonce, len(value)), strict=True))
        return nonce + body + self._tag(self._name(key), nonce, body)

    def open(self, key: str, sealed: bytes) -> bytes:
        if len(sealed) < NONCE + TAG:
            raise SealedStoreError(f"transfer store: a value for {key!r} not written by this transfer")
        nonce, body, tag = sealed[:NONCE], sealed[NONCE:-TAG], sealed[-TAG:]
        if not hmac.compare_digest(tag, self._tag(self._name(key), nonce, body)):
            raise SealedStoreError(f"transfer store: a value for {key!r} not written by this transfer")
        return bytes(a ^ b for a, b in zip(body, self._stream(nonce, len(body)), strict=True))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(self._name(key), self.seal(key, data))

    def get(self, key: str) -> bytes:
        return self.open(key, bytes(self._inner.get(self._name(key))))

    def add(self, key: str, amount: int) -> int:  # a counter: named secretly, its value in the clear
        return self._inner.add(self._name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._name(k) for k in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout
