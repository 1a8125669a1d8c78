"""Benchmark: what the pipeline (sealing, database, broker, leases, audit) adds per document over calling the
engine directly on the same documents with the same batching.

    python benchmarks/pipeline_overhead.py [--documents 64] [--database-url URL --broker-url URL] [--json F]

Runs on the CPU with the random demo model. Prints one table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine
from jobs import make_kind
from jobs.base import Document, EngineModel
from pipeline import envelope, keys
from pipeline.client import ClientSession, fetch_results, submit_files
from pipeline.home import ensure_model, init
from pipeline.settings import Limits, load_settings
from pipeline.worker_process import WorkerOptions, run_worker

NOTE = (Path(__file__).resolve().parents[1] / "pipeline" / "demo_notes" / "note-02-pneumonia.txt").read_text()


def documents(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"doc-{i:03d}.txt").write_text(f"Document {i}.\n{NOTE}")
    return folder


def direct(model_dir: Path, folder: Path, params: dict, shard_size: int) -> float:
    """The engine alone: same prompts, same shards, no crypto, database or broker."""
    engine = Engine.from_pretrained(model_dir, device="cpu", dtype="float32")
    model, kind = EngineModel(engine), make_kind("summarize", params)
    files = sorted(folder.iterdir())
    start = time.perf_counter()
    for i in range(0, len(files), shard_size):
        docs = [Document(f.name, f.read_bytes()) for f in files[i : i + shard_size]]
        requests = [r for d in docs for r in kind.requests(d, model)]
        outs = engine.generate([r.prompt for r in requests], [r.sampling for r in requests])
        for d, o in zip(docs, outs, strict=True):
            kind.result(d, [o])
    return time.perf_counter() - start


def crypto_micro(size: int, repeat: int = 200) -> dict:
    service, client = keys.generate_identity(), keys.generate_identity()
    payload = envelope.pack_document("doc.txt", b"x" * size)
    t = time.perf_counter()
    sealed = [envelope.seal_document(payload, service.public.x25519, "job", f"d{i}") for i in range(repeat)]
    seal_us = (time.perf_counter() - t) / repeat * 1e6
    t = time.perf_counter()
    for i, s in enumerate(sealed):
        envelope.open_document(s, service, "job", f"d{i}")
    open_us = (time.perf_counter() - t) / repeat * 1e6
    t = time.perf_counter()
    for i in range(repeat):
        envelope.seal_result(b"y" * 300, client.public.x25519, "job", f"d{i}")
    return {
        "seal_document_us": seal_us,
        "open_document_us": open_us,
        "seal_result_us": (time.perf_counter() - t) / repeat * 1e6,
    }


def pipeline_run(home: Path, folder: Path, params: dict, args) -> dict:
    env = {"ENCLAVE_HOME": str(home)}
    if args.database_url:
        env["ENCLAVE_DATABASE_URL"] = args.database_url
    if args.broker_url:
        env["ENCLAVE_BROKER_URL"] = args.broker_url
    settings = replace(
        load_settings(env),
        device="cpu",
        dtype="float32",
        limits=Limits(shard_size=args.shard_size, lease_seconds=120),
    )
    init(settings, client_name="bench")
    session = ClientSession(settings)
    t0 = time.perf_counter()
    job = submit_files(session, [folder], "summarize", params)
    t1 = time.perf_counter()
    options = WorkerOptions(args.concurrency, until_idle=True, loglevel=args.loglevel, metrics_port=-1)
    run_worker(settings, options)
    t2 = time.perf_counter()
    _, records = fetch_results(session, job.job_id)
    t3 = time.perf_counter()
    session.close()
    assert all(r["status"] == "done" for r in records), "every benchmark document should succeed"
    return {
        "submit_s": t1 - t0,
        "worker_s": t2 - t1,
        "results_s": t3 - t2,
        "total_s": t3 - t0,
        "model": str(ensure_model(settings)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs=2, default=[32, 128], metavar=("SMALL", "LARGE"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--database-url")
    parser.add_argument("--broker-url")
    parser.add_argument("--json")
    parser.add_argument("--loglevel", default="WARNING")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(
        level=getattr(logging, args.loglevel), format="%(relativeCreated)7.0f %(name)s: %(message)s"
    )
    params = {"max_tokens": str(args.max_tokens)}
    runs = []
    for n in args.documents:
        with tempfile.TemporaryDirectory() as tmp:
            folder = documents(Path(tmp) / "docs", n)
            piped = pipeline_run(Path(tmp) / "home", folder, params, args)
            # Same model, documents and shards; the median of 3 keeps noise out of the baseline.
            engine_s = statistics.median(
                direct(Path(piped["model"]), folder, params, args.shard_size) for _ in range(3)
            )
        runs.append(
            {"documents": n, "engine_direct_s": engine_s, **{k: v for k, v in piped.items() if k != "model"}}
        )
    small, large = runs
    dn = large["documents"] - small["documents"]
    # Marginal cost per extra document (fixed start-up and idle detection cancel out), and the fixed part.
    marginal_ms = (
        (large["total_s"] - large["engine_direct_s"]) - (small["total_s"] - small["engine_direct_s"])
    ) / dn
    marginal_ms *= 1000
    fixed_s = (small["total_s"] - small["engine_direct_s"]) - marginal_ms / 1000 * small["documents"]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} CPU, Python {platform.python_version()}",
        "database": args.database_url or "sqlite (embedded)",
        "broker": args.broker_url or "sqla+sqlite (embedded)",
        "document_bytes": len(f"Document 0.\n{NOTE}".encode()),
        "max_tokens": args.max_tokens,
        "shard_size": args.shard_size,
        "runs": runs,
        "overhead_per_document_ms": marginal_ms,
        "fixed_overhead_s": fixed_s,
        "crypto": crypto_micro(len(NOTE)),
    }
    print(
        f"summarize, max_tokens={args.max_tokens}, shards of {args.shard_size}, "
        f"{result['document_bytes']}-byte documents; database {result['database']}, broker {result['broker']}"
    )
    print(
        f"{'documents':>9} {'engine s':>9} {'submit s':>9} {'worker s':>9} {'results s':>10} {'total s':>8}"
    )
    for r in runs:
        print(
            f"{r['documents']:>9} {r['engine_direct_s']:>9.2f} {r['submit_s']:>9.2f} {r['worker_s']:>9.2f} "
            f"{r['results_s']:>10.2f} {r['total_s']:>8.2f}"
        )
    print(
        f"pipeline overhead per document: {marginal_ms:.1f} ms (marginal); fixed per run: {fixed_s:.1f} s "
        "(worker start, engine load, idle detection)"
    )
    c = result["crypto"]
    print(
        f"HPKE per document: seal {c['seal_document_us']:.0f} us, open {c['open_document_us']:.0f} us, "
        f"seal result {c['seal_result_us']:.0f} us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
