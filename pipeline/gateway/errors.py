"""The gateway's own errors, answered in OpenAI's envelope `{"error": {message, type, param, code}}` with
OpenAI's HTTP status codes (400 a bad request, 401 a missing or wrong API key, 404 an unknown object or url,
409 a batch that can no longer be cancelled, 413 a file too large, 500 anything unexpected).

Messages name parameters, ids, sizes and limits, never a value the request carried: they are content-free,
like every other reason in Enclave.
"""

from __future__ import annotations

from pipeline.gateway.models import ErrorBody, ErrorEnvelope

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class GatewayError(Exception):
    """An answer other than 2xx: the HTTP status and the body of OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = INVALID_REQUEST,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(error=self.body)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def missing(param: str) -> GatewayError:
    return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def invalid_value(param: str, expected: str) -> GatewayError:
    return bad_request(f"Invalid value for '{param}': {expected}.", param, "invalid_value")


def invalid_type(param: str, expected: str) -> GatewayError:
    return bad_request(f"Invalid type for '{param}': expected {expected}.", param, "invalid_type")


def unknown_parameter(param: str) -> GatewayError:
    return bad_request(f"Unknown parameter: '{param}'.", param, "unknown_parameter")


def no_such_file(file_id: str, param: str = "file_id") -> GatewayError:
    return GatewayError(404, f"No such File object: {file_id}", param=param)


def no_such_batch(batch_id: str) -> GatewayError:
    return GatewayError(404, f"No batch found with id '{batch_id}'.", param="batch_id")


def internal() -> GatewayError:
    return GatewayError(
        500,
        "The gateway had an internal error; its stack trace is in the Enclave home's logs/enclave.log.",
        type=SERVER_ERROR,
    )
