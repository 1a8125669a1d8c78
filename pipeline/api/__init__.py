"""`enclave serve`: the service API, the only client-facing holder of the database and broker credentials.

| file | concern |
|---|---|
| `errors.py` | `ApiError`: a refusal's HTTP status, code and one-line message |
| `auth.py` | who is asking: signed requests checked against the allow-list, revocation and the nonce store |
| `jobs.py` | a client's own jobs: the chunked submit, list, status, cancel, results pages, and dispatch |
| `admin.py` | administrators: the allow-list and the audit log |
| `app.py` | the Starlette app: bounded bodies, typed messages, thin routes |
| `serve.py` | `enclave serve`: the socket, TLS, uvicorn |

The same app runs in-process when the CLI has no `ENCLAVE_SERVICE_URL` (`pipeline/inprocess.py`).
"""
