"""The session helper: one agent run = one steptap session, opened and closed around a block.

    with steptap.adapters.session(group_id="task-7", reward=grade) as s:
        client = s.openai_client()          # or s.base_url / s.api_key for any framework
        run_my_agent(client)
        s.set_reward(1.0)                   # or let ``grade(trajectory)`` compute it on exit

On a clean exit the session is finished with the reward set inside the block (that wins) or, failing that, the
one the ``reward`` callable computes from the trajectory. On an exception (KeyboardInterrupt and task
cancellation included) it is finished as ``aborted`` and the exception propagates: the session is never left
open, and the aborted trajectory is still delivered on the stream (an aborted member does not discard its
group).

Depends on ``steptap.middleware.client`` only; ``openai`` is imported when a client is asked for.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from steptap.middleware.client import TOKEN_ENV

if TYPE_CHECKING:
    from steptap.middleware.records import Trajectory

logger = logging.getLogger("steptap.adapters")

RewardValue = float | int | dict[str, float] | None
RewardFn = Callable[["Trajectory"], RewardValue | Awaitable[RewardValue]]

URL_ENV = "STEPTAP_URL"
MODEL_ENV = "STEPTAP_MODEL"


def proxy_settings(proxy_url: str | None, control_token: str | None) -> tuple[str, str]:
    """The proxy URL and control token, from the arguments or STEPTAP_URL / STEPTAP_CONTROL_TOKEN."""
    url = proxy_url or os.environ.get(URL_ENV)
    from steptap.middleware.client import default_control_token

    token = control_token or default_control_token()
    if not url:
        raise ValueError(f"no steptap proxy URL: pass proxy_url= or set {URL_ENV}")
    if not token:
        raise ValueError(f"no steptap control token: pass control_token= or set {TOKEN_ENV}")
    return url.rstrip("/"), token


def served_model(base_url: str, api_key: str, timeout: float = 10.0) -> str:
    """The first model the proxy serves (``GET {base_url}/models`` with the session's key)."""
    from steptap.middleware.client import SteptapError, SyncSteptapClient

    client = SyncSteptapClient(base_url, api_key, timeout_s=timeout)  # it strips /v1
    try:
        models = client.models()
    except (OSError, ValueError, SteptapError) as exc:
        raise RuntimeError(f"cannot list the models served at {base_url}: {exc}") from exc
    if not models:
        raise RuntimeError(f"the proxy at {base_url} serves no model")
    return models[0]


def resolve_model(session: Any, model: str | None) -> str:
    """The model name an adapter should request: the argument, the session's, STEPTAP_MODEL, or the first one
    the proxy serves."""
    if model:
        return model
    name = getattr(session, "model", None) or os.environ.get(MODEL_ENV)
    if name:
        return name
    name = served_model(session.base_url, session.api_key)
    if hasattr(session, "model"):
        session.model = name  # ask once per session
    return name


class _SessionBase:
    """What the sync and async helpers share: the session's identity, clients, and the pending reward."""

    def __init__(
        self,
        proxy_url: str | None = None,
        control_token: str | None = None,
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        mode: str = "train",
        metadata: dict[str, Any] | None = None,
        idle_timeout_s: float | None = None,
        reward: RewardFn | None = None,
        model: str | None = None,
        client: Any = None,
    ) -> None:
        if client is None:
            self.proxy_url, self.control_token = proxy_settings(proxy_url, control_token)
        else:
            self.proxy_url, self.control_token = proxy_url or "", control_token or ""
        self.group_id = group_id
        self.group_size = group_size
        self.mode = mode
        self.metadata = dict(metadata or {})
        self.idle_timeout_s = idle_timeout_s
        self.reward_fn = reward
        self.model = model
        self.id = ""
        self.base_url = ""
        self.api_key = ""
        self.status: str | None = None  # "finished" or "aborted" once closed
        self._client = client
        self._owns_client = client is None
        self._rewards: dict[str | None, float] = {}
        self._pending: tuple[float | None, str | float] | None = None  # set_reward_pending()
        self._clients: list[Any] = []

    # -- what the agent gets -------------------------------------------------------------------------------
    def openai_client(self, **kw: Any) -> Any:
        """An ``openai.OpenAI`` client bound to this session (closed when the session closes)."""
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kw)
        self._clients.append(client)
        return client

    def async_openai_client(self, **kw: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client bound to this session (closed when an async session closes)."""
        import openai

        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kw)
        self._clients.append(client)
        return client

    def anthropic_client(self, **kw: Any) -> Any:
        """An ``anthropic.Anthropic`` client bound to this session (base URL ``/s/<id>``: its SDK adds
        ``/v1/messages``; the session key goes in ``x-api-key``)."""
        import anthropic

        client = anthropic.Anthropic(base_url=self.anthropic_base_url, api_key=self.api_key, **kw)
        self._clients.append(client)
        return client

    def async_anthropic_client(self, **kw: Any) -> Any:
        """An ``anthropic.AsyncAnthropic`` client bound to this session (closed when an async session
        closes)."""
        import anthropic

        client = anthropic.AsyncAnthropic(base_url=self.anthropic_base_url, api_key=self.api_key, **kw)
        self._clients.append(client)
        return client

    @property
    def anthropic_base_url(self) -> str:
        """The session's base URL without ``/v1`` (what Anthropic's SDK and ``ANTHROPIC_BASE_URL`` expect)."""
        from steptap.middleware.client import split_url

        return split_url(self.base_url)[0]

    def bind(self, adapter: str, **kw: Any) -> Any:
        """A framework object on this session through its registered adapter: ``s.bind("langchain")``."""
        from steptap.adapters.registry import bind

        return bind(adapter, self, **kw)

    def env(self) -> dict[str, str]:
        """Environment variables that point an OpenAI-compatible program at this session."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "STEPTAP_SESSION_ID": self.id,
        }

    def set_reward(self, value: float, name: str | None = None) -> None:
        """The trajectory reward to finish with (named components add up); wins over the callable."""
        self._rewards[name] = float(value)

    def set_reward_pending(self, deadline_s: float | None = None, on_deadline: str | float = "drop") -> None:
        """Finish with the reward pending: the trajectory is held off the stream until a reward arrives
        (``client.add_reward(session_id, value)``, from anywhere, later) or ``deadline_s`` passes
        (``on_deadline``: "drop", or the reward it gets). Named components set here are still sent."""
        self._pending = (deadline_s, on_deadline)

    # -- helpers -------------------------------------------------------------------------------------------
    def _open_kwargs(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "group_size": self.group_size,
            "mode": self.mode,
            "metadata": self.metadata,
            "idle_timeout_s": self.idle_timeout_s,
        }

    def _adopt(self, info: Any) -> None:
        self.id, self.base_url, self.api_key = info.id, info.base_url, info.api_key

    def _unreachable(self, exc: OSError) -> ConnectionError:
        reason = getattr(exc, "reason", None) or getattr(exc, "os_error", None) or exc  # urllib's / aiohttp's
        where = self.proxy_url or "the proxy"
        return ConnectionError(
            f"cannot reach the steptap proxy at {where} ({reason}); is `steptap serve` running? "
            f"(proxy_url= or {URL_ENV})"
        )

    def _finish_reward(self, rewards: dict[str | None, float]) -> dict[str, Any]:
        if self._pending is None or None in rewards:  # a reward set in the block wins over pending
            return {"reward": rewards.get(None)}
        return {"reward": "pending", "deadline_s": self._pending[0], "on_deadline": self._pending[1]}

    @staticmethod
    def _as_rewards(value: RewardValue) -> dict[str | None, float]:
        if value is None:
            return {}
        if isinstance(value, dict):
            return {str(k): float(v) for k, v in value.items()}
        return {None: float(value)}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id!r} group_id={self.group_id!r} status={self.status!r}>"


class Session(_SessionBase):
    """The synchronous helper (``with session(...) as s``), on ``SyncSteptapClient``."""

    def __enter__(self) -> Session:
        if self._client is None:
            from steptap.middleware.client import SyncSteptapClient

            self._client = SyncSteptapClient(self.proxy_url, self.control_token)
        try:
            self._adopt(self._client.open_session(**self._open_kwargs()))
        except OSError as exc:
            self._close_client()
            raise self._unreachable(exc) from exc
        except BaseException:
            self._close_client()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        try:
            if exc is not None:
                self._abort(exc)
                return False
            try:
                rewards = self._rewards if self._rewards or self._pending else self._as_rewards(
                    self._compute_reward())
            except BaseException as err:
                self._abort(err)
                raise
            self._finish(rewards)
            return False
        finally:
            for client in self._clients:
                if inspect.iscoroutinefunction(client.close):
                    continue  # an AsyncOpenAI made in a sync block: its owner's loop closes it
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            self._close_client()

    def trajectory(self) -> Trajectory:
        """The trajectory so far (``GET /sessions/<id>``)."""
        return self._client.get_session(self.id)

    def reward_step(self, value: float, step: int | str = "last", name: str | None = None) -> None:
        """Attach a per-step (process) reward now, to step ``step`` (an index, or ``"last"``: the latest)."""
        self._client.add_reward(self.id, float(value), name=name, step=step)

    def _compute_reward(self) -> RewardValue:
        if self.reward_fn is None:
            return None
        value = self.reward_fn(self.trajectory())
        if inspect.isawaitable(value):
            raise TypeError("an async reward callable needs async_session()")
        return value

    def _finish(self, rewards: dict[str | None, float]) -> None:
        for name, value in rewards.items():
            if name is not None:
                self._client.add_reward(self.id, value, name=name)
        self._client.finish(self.id, status="finished", **self._finish_reward(rewards))
        self.status = "finished"

    def _abort(self, exc: BaseException) -> None:
        try:
            self._client.finish(self.id, status="aborted", error=_why(exc))
            self.status = "aborted"
        except Exception as err:  # noqa: BLE001 - never mask the agent's own exception
            logger.warning("steptap: could not abort session %s after %r: %s", self.id, exc, err)

    def _close_client(self) -> None:
        if self._owns_client and self._client is not None:
            close = getattr(self._client, "close", None)
            if close is not None:
                close()


def _why(exc: BaseException) -> str:
    """What ended a session aborted, kept on its trajectory (its error)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class AsyncSession(_SessionBase):
    """The asynchronous helper (``async with async_session(...) as s``), on ``SteptapClient``."""

    async def __aenter__(self) -> AsyncSession:
        if self._client is None:
            from steptap.middleware.client import SteptapClient

            self._client = SteptapClient(self.proxy_url, self.control_token)
        try:
            self._adopt(await self._client.open_session(**self._open_kwargs()))
        except OSError as exc:
            await self._close_client()
            raise self._unreachable(exc) from exc
        except BaseException:
            await self._close_client()
            raise
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            if exc is not None:
                await self._abort(exc)
                return False
            try:
                rewards = self._rewards if self._rewards or self._pending else self._as_rewards(
                    await self._compute_reward())
            except BaseException as err:
                await self._abort(err)
                raise
            await self._finish(rewards)
            return False
        finally:
            for client in self._clients:
                try:
                    result = client.close()
                    if inspect.isawaitable(result):
                        await result
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            await self._close_client()

    async def trajectory(self) -> Trajectory:
        return await self._client.get_session(self.id)

    async def reward_step(self, value: float, step: int | str = "last", name: str | None = None) -> None:
        await self._client.add_reward(self.id, float(value), name=name, step=step)

    async def _compute_reward(self) -> RewardValue:
        if self.reward_fn is None:
            return None
        value = self.reward_fn(await self.trajectory())
        if inspect.isawaitable(value):
            value = await value
        return value

    async def _finish(self, rewards: dict[str | None, float]) -> None:
        for name, value in rewards.items():
            if name is not None:
                await self._client.add_reward(self.id, value, name=name)
        await self._client.finish(self.id, status="finished", **self._finish_reward(rewards))
        self.status = "finished"

    async def _abort(self, exc: BaseException) -> None:
        try:
            await self._client.finish(self.id, status="aborted", error=_why(exc))
            self.status = "aborted"
        except Exception as err:  # noqa: BLE001 - never mask the agent's own exception
            logger.warning("steptap: could not abort session %s after %r: %s", self.id, exc, err)

    async def _close_client(self) -> None:
        if self._owns_client and self._client is not None:
            for attr in ("aclose", "close"):
                close = getattr(self._client, attr, None)
                if close is not None:
                    result = close()
                    if inspect.isawaitable(result):
                        await result
                    break


def session(proxy_url: str | None = None, control_token: str | None = None, **kw: Any) -> Session:
    """A synchronous session context manager; see the module docstring. Keyword arguments: ``group_id``,
    ``group_size``, ``mode``, ``metadata``, ``idle_timeout_s``, ``reward`` (callable on the trajectory),
    ``model`` (default model name for adapters), ``client`` (an existing ``SyncSteptapClient``)."""
    return Session(proxy_url, control_token, **kw)


def async_session(proxy_url: str | None = None, control_token: str | None = None, **kw: Any) -> AsyncSession:
    """The asynchronous twin of :func:`session` (``client``: an existing ``SteptapClient``)."""
    return AsyncSession(proxy_url, control_token, **kw)
