"""Domain errors: what the session domain, the log, the upstream client and the weight swapper raise when a
request cannot be served. They know nothing of HTTP; ``errors.py`` (the edge) turns each into an OpenAI error
body with its status, so the domain reads as plain Python and the routes stay thin."""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error a request can end in. ``code`` is the machine-readable code agents see."""

    code: str = "error"  # each class's own; an instance may carry a finer one

    def __init__(self, message: str, code: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:  # a finer code than the class's (the status stays the class's: errors._STATUS)
            self.code = code
        self.retry_after_s = retry_after_s  # set on errors worth retrying (overload): sent as Retry-After


class InvalidRequest(DomainError):
    """The request itself is wrong (a bad id, a bad value)."""

    code = "invalid_request"


# --- sessions -----------------------------------------------------------------------------------------------
class SessionNotFound(DomainError):
    code = "session_not_found"


class SessionEvicted(DomainError):
    """Closed long enough ago that only the stream still has it."""

    code = "session_evicted"


class SessionClosed(DomainError):
    code = "session_closed"


class SessionExists(DomainError):
    code = "session_exists"


class UnknownSessionKey(DomainError):
    code = "invalid_api_key"


class WrongSessionKey(DomainError):
    """A keyed session reached without its key (a path or header id alone, or another session's key)."""

    code = "session_key_required"


class RewardUnavailable(Exception):
    """Raised by a reward callback (``--reward``) that cannot make a reward at all: a judge model that is down
    or answers garbage, a grader that could not run. An infrastructure failure, never a reward of 0: the
    session ends ``records.INFRA_FAILURE`` with this message as its error, and is never trained. (Any other
    exception of a callback is recorded in the trajectory's error, which is still delivered as finished.)"""


class StepNotFound(DomainError):
    code = "step_not_found"


class GroupNotFound(DomainError):
    code = "group_not_found"


class SessionFull(DomainError):
    """An open session holds as many steps or bytes as it may: finish it, or raise the limit."""

    code = "session_full"


class Overloaded(DomainError):
    """Too many model calls in flight: the caller should retry later."""

    code = "too_many_calls"


# --- the backend --------------------------------------------------------------------------------------------
class ModelNotFound(DomainError):
    code = "model_not_found"


class BackendUnreachable(DomainError):
    code = "backend_unreachable"


class BackendUnavailable(DomainError):
    code = "backend_unavailable"


class BackendTimeout(DomainError):
    code = "backend_timeout"


class BackendError(DomainError):
    code = "backend_error"


class BackendStatus(BackendError):
    """The backend answered a call steptap makes for itself (render, generate, derender) with an error status:
    ``status`` and vLLM's ``body`` (a model call's error status goes to the agent as vLLM sent it)."""

    def __init__(self, backend: str, status: int, body: bytes) -> None:
        super().__init__(f"backend {backend} answered {status}")
        self.status = status
        self.body = body


class BackendCut(DomainError):
    code = "backend_cut"


class BackendMalformed(DomainError):
    code = "backend_malformed_reply"


class SwapCut(DomainError):
    """A weight swap cut the call: it outlasted the swap's drain bound. A retry runs on the new weights."""

    code = "swap_cut"


# --- the weight swap (weights/) -----------------------------------------------------------------------------
class SwapError(DomainError):
    """A swap that failed on a replica: the old version keeps serving (its message says otherwise)."""

    code = "swap_failed"


class SwapRefused(SwapError):
    """Refused before anything paused: bad weights, a bad body."""

    code = "invalid_request"


class StaleVersion(SwapError):
    code = "stale_version"


class SwapUnavailable(SwapError):
    """Nothing to swap now (no healthy replica, calls that would not drain)."""

    code = "no_backend"


class SwapNotPersisted(SwapError):
    """The new version could not be written to the log: it never went live."""

    code = "log_error"


# --- the log ------------------------------------------------------------------------------------------------
class RecordTooLarge(DomainError):
    code = "record_too_large"


class RequestTooComplex(DomainError):
    """A model-call body with more JSON values than ``max_json_nodes`` (refused before decoding)."""

    code = "request_too_complex"


class LogUnavailable(DomainError):
    """The trajectory log cannot write (disk full, I/O error): nothing new is accepted until it can."""

    code = "log_unavailable"
