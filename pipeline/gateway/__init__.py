"""`enclave gateway`: OpenAI's Files and Batch API served on the client workstation (127.0.0.1).

An unchanged OpenAI-SDK batch script points its `base_url` here. Every uploaded line is sealed with the
client's own key before it is stored, even locally; a batch is submitted through `pipeline.client` (the
lines sealed to the service there), and its results are opened on this machine. The gateway never reaches
the database or the broker itself.

| file | concern |
|---|---|
| `models.py` | OpenAI's objects (file, batch, list page, output line, error envelope) as pydantic models |
| `errors.py` | the gateway's own errors, in OpenAI's envelope, with their HTTP status codes |
| `store.py` | the local store: files sealed line by line, batch records with sealed metadata |
| `state.py` | Enclave job state and counts -> the batch's status, `request_counts` and next step |
| `outputs.py` | opened result records -> the lines of the output and error files |
| `service.py` | the operations behind the routes: files, batches, their lifecycle through `pipeline.client` |
| `routes.py` | the Starlette app: requests parsed and bounded, answers and errors in OpenAI's shapes |
| `server.py` | `enclave gateway`: the loopback bind, the API key, uvicorn |
"""
