"""The exception tree users catch. Every error names its cause and, where there is one, the remedy."""

from __future__ import annotations


class ShoalError(Exception):
    """Base of every error shoal raises."""


class InvalidRequestError(ShoalError, ValueError):
    """The request cannot be served as given (bad argument, impossible limit)."""


class UnsupportedKindError(InvalidRequestError):
    """The sandbox kind is unknown or not available on this node."""


class NoScreenError(InvalidRequestError):
    """A GUI action on a sandbox that has no screen (create it with screen=(w, h), e.g. image='desktop')."""


class NoAgentError(InvalidRequestError):
    """An operation that needs shoal's guest agent (exec, files, shells, processes, env, user, workdir, a
    network policy) on an agentless vm (a user's disk image, e.g. Android): the message names what works."""


class NotFoundError(ShoalError, LookupError):
    """Something named in the request does not exist."""


class SandboxNotFoundError(NotFoundError):
    """No sandbox with that ID exists (it was never made, or it has been closed)."""


class ShellLostError(NotFoundError):
    """A shell session was lost because the node restarted (its process belonged to the old node's agent
    connection); the sandbox itself lives on: open a new shell."""


class ProcessNotFoundError(NotFoundError):
    """No background process with that ID in the sandbox: never started there, or it ended and the agent
    let it go (sb.processes(background=True) lists the ones it keeps)."""


class ImageError(ShoalError):
    """An image could not be built, imported or used."""


class ImageNotFoundError(ImageError, NotFoundError):
    """No image by that name is known to the node."""


class SandboxClosedError(SandboxNotFoundError):
    """The sandbox was closed (by the client, a TTL, or a kill); it takes no more requests."""


class SandboxLostError(ShoalError):
    """The sandbox died or its agent stopped answering; its state is gone."""


class CapacityError(ShoalError):
    """The node cannot take more sandboxes of this shape right now."""


class TimeoutError(ShoalError, TimeoutError):  # noqa: A001 - deliberate: also a builtin TimeoutError
    """An operation (not an exec: execs report `timed_out`) did not finish in time."""


class NodeError(ShoalError):
    """The node agent could not be reached or started."""


class TLSError(NodeError):
    """A TLS connection could not be made: the server's certificate is not trusted, or it does not speak TLS."""


class DivergenceError(ShoalError):
    """A re-issued step differs from the one recorded in the trajectory log."""


class AuthenticationError(ShoalError, PermissionError):
    """The token is missing, unknown, or not allowed to do this."""


class QuotaExceededError(ShoalError):
    """The request would take the project past one of its quotas (sandboxes, CPU, memory)."""


class NodeSettingsWarning(UserWarning):
    """The running local node was started with other SHOAL_* settings than this client's environment has;
    it keeps its own until it is restarted (`shoal node stop`, then connect again)."""


class PayloadNotKeptError(ShoalError):
    """A logged step's bulk payload (a file read over 64 KiB) was kept in the trajectory log only as its
    digest and size, and the file no longer holds those bytes, so the step cannot be answered again."""


class UnsafeEntryWarning(UserWarning):
    """A download skipped what the sandbox reported because it could lead outside the local target
    (a symlink to an absolute path or out through `..`, a name that is not a plain relative path)."""


ERROR_TYPES: dict[str, type[ShoalError]] = {
    cls.__name__: cls
    for cls in [
        ShoalError,
        InvalidRequestError,
        UnsupportedKindError,
        NoScreenError,
        NoAgentError,
        NotFoundError,
        SandboxNotFoundError,
        ShellLostError,
        ProcessNotFoundError,
        ImageError,
        ImageNotFoundError,
        SandboxClosedError,
        SandboxLostError,
        CapacityError,
        TimeoutError,
        NodeError,
        TLSError,
        DivergenceError,
        AuthenticationError,
        QuotaExceededError,
        PayloadNotKeptError,
    ]
}


_BUILTIN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
}
CANCELLED = "CancelledError"


def to_wire(exc: BaseException) -> tuple[str, str, bool]:
    """The one mapping from an exception to a wire error: (type, message, expected).

    Typed errors (and the file errors a sandbox's agent reports) keep their class name and message;
    cancellation is "CancelledError"; anything else is a bug, sent as a ShoalError naming the Python
    exception, with `expected` False so the server logs its traceback."""
    import asyncio

    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED, "cancelled", True
    name = type(exc).__name__
    if isinstance(exc, ShoalError) and name in ERROR_TYPES:
        return name, str(exc), True
    if isinstance(exc, ShoalError):  # a subclass defined elsewhere: its nearest wire type
        base = next(c for c in type(exc).__mro__ if c.__name__ in ERROR_TYPES)
        return base.__name__, str(exc), True
    builtin = next((c.__name__ for c in type(exc).__mro__ if _BUILTIN_ERRORS.get(c.__name__) is c), None)
    if builtin is not None:  # a file error the agent reported (or a subclass of one): its builtin class
        return builtin, str(exc), True
    return "ShoalError", f"{name}: {exc}", False


def from_wire(kind: str, message: str) -> Exception:
    """The exception a wire error stands for (the inverse of `to_wire`)."""
    if kind == CANCELLED:
        return ShoalError(f"cancelled on the server: {message}")
    cls = ERROR_TYPES.get(kind) or _BUILTIN_ERRORS.get(kind) or ShoalError
    return cls(message)
