"""OpenAI's Files and Batch objects as the gateway serves them, field for field as OpenAI documents them
(the openai package's `openai.types`: `FileObject`, `FileDeleted`, `Batch`, `BatchError`,
`BatchRequestCounts`, `BatchUsage`; cursor pages; the lines of batch output and error files; the error
envelope). Timestamps are Unix seconds; ids are `file-<hex>` and `batch_<hex>`.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FilePurpose = Literal["batch", "batch_output"]
# The urls Enclave's `chat` kind serves; OpenAI's other batch endpoints are refused at create.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW = "24h"  # the only window OpenAI offers
WINDOW_SECONDS = 24 * 3600
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's limits on `metadata`

T = TypeVar("T")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchError(BaseModel):
    """A batch-level problem (the batch failed): a code, a content-free message, the line if any."""

    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class Page(BaseModel, Generic[T]):
    """A cursor page of `GET /v1/files` or `GET /v1/batches`: the next page starts `after` `last_id`."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class CreateBatch(BaseModel):
    """The body of `POST /v1/batches` (checked by `routes.create_batch_request`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class Response(BaseModel):
    """The HTTP answer a request of a batch got: its status code and body (an error body when not 200)."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    """Why a request got no answer at all: `batch_cancelled`, `batch_expired` (OpenAI's codes), or
    `result_refused` (Enclave's: the result did not carry the service's valid signature)."""

    code: str
    message: str


class OutputLine(BaseModel):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: Response | None
    error: LineError | None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody
