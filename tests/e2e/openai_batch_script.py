"""A batch script written for OpenAI's Batch API, the way its guide writes one. It knows nothing of Enclave:
`tests/e2e/test_gateway.py` runs it unchanged, with OPENAI_BASE_URL and OPENAI_API_KEY pointing it at
`enclave gateway`.

    python openai_batch_script.py REQUESTS.jsonl SECOND.jsonl OUT_DIR METADATA_JSON

It uploads REQUESTS.jsonl, creates a batch, polls it until it ends, downloads its output and error files;
creates a second batch from SECOND.jsonl and cancels it once it runs; lists every batch a page at a time.
What it saw goes to OUT_DIR/summary.json.
"""

import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI

ENDED = ("completed", "failed", "expired", "cancelled")
POLL_SECONDS = float(os.environ.get("POLL_SECONDS", "10"))


def wait(client: OpenAI, batch, seen: list[str]):
    while batch.status not in ENDED:
        time.sleep(POLL_SECONDS)
        batch = client.batches.retrieve(batch.id)
        seen.append(batch.status)
    return batch


def main(requests: Path, second: Path, out: Path, metadata: dict) -> int:
    client = OpenAI()
    out.mkdir(parents=True, exist_ok=True)
    with open(requests, "rb") as f:
        batch_input_file = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=batch_input_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata,
    )
    seen = [batch.status]
    batch = wait(client, batch, seen)
    print(f"batch {batch.id}: {batch.status}, {batch.request_counts}")
    if batch.output_file_id:
        client.files.content(batch.output_file_id).write_to_file(out / "output.jsonl")
    if batch.error_file_id:
        client.files.content(batch.error_file_id).write_to_file(out / "errors.jsonl")

    with open(second, "rb") as f:
        second_file = client.files.create(file=f, purpose="batch")
    cancelled = client.batches.create(
        input_file_id=second_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while cancelled.status == "validating":  # cancel it once it runs
        time.sleep(POLL_SECONDS)
        cancelled = client.batches.retrieve(cancelled.id)
    cancelled = client.batches.cancel(cancelled.id)
    cancel_seen = [cancelled.status]
    cancelled = wait(client, cancelled, cancel_seen)
    print(f"batch {cancelled.id}: {cancelled.status}, {cancelled.request_counts}")
    if cancelled.output_file_id:
        client.files.content(cancelled.output_file_id).write_to_file(out / "cancelled-output.jsonl")
    if cancelled.error_file_id:
        client.files.content(cancelled.error_file_id).write_to_file(out / "cancelled-errors.jsonl")

    listed = [b.id for b in client.batches.list(limit=1)]  # the SDK follows the cursor page by page
    summary = {
        "input_file": batch_input_file.model_dump(mode="json"),
        "batch": batch.model_dump(mode="json"),
        "statuses": seen,
        "cancelled": cancelled.model_dump(mode="json"),
        "cancel_statuses": cancel_seen,
        "listed": listed,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])))
