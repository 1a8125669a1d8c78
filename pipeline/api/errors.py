"""The service API's refusals: an HTTP status, a short code and a one-line message that says what to do and
quotes nothing a client sent."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal, answered as `{"error": {"code", "message"}}` with `status`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def not_found(job: str) -> ApiError:
    """The same answer for a job that does not exist and another client's: neither is this client's."""
    return ApiError(404, "not_found", f"no job {job} for this client")


def malformed(what: str) -> ApiError:
    return ApiError(400, "malformed", what)


def conflict(message: str) -> ApiError:
    return ApiError(409, "conflict", message)
