"""The report: where and how the run happened as plain data, the table printed at the end, the JSON file."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from engine.bench.serving import PEERS, peer_metric
from engine.bench.traffic import ParamCounts
from engine.config import ModelConfig
from engine.env import engine_env


def environment(device: torch.device) -> dict[str, Any]:
    """When, on what and with which versions the run happened: the report's first keys."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(device),
        "device": str(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": _commit(),
    }


def param_summary(counts: ParamCounts) -> dict[str, float]:
    """The parameter counts the report keeps."""
    return {
        "total": counts.total,
        "mtp": counts.mtp,
        "active_per_token_batch_1": counts.active(1),
        "embedding": counts.embedding,
        "lm_head": counts.lm_head,
        "dense": counts.dense,
        "per_expert": counts.expert,
    }


def geometry(config: ModelConfig) -> dict[str, Any]:
    """The model's shape in a few readable lines."""
    return {
        "layers": config.num_hidden_layers,
        "full_attention_layers": len(config.full_attention_layers),
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "heads": f"{config.num_attention_heads} q / {config.num_key_value_heads} kv x {config.head_dim}",
        "linear_heads": (
            f"{config.linear_num_key_heads} k x {config.linear_key_head_dim} / "
            f"{config.linear_num_value_heads} v x {config.linear_value_head_dim}"
        ),
        "experts": f"{config.num_experts} top-{config.num_experts_per_tok} x {config.moe_intermediate_size}",
        "shared_expert": config.shared_expert_intermediate_size,
        "mtp_layers": config.mtp_num_hidden_layers,
    }


def load_text(spread: dict[str, Any]) -> str:
    """`expert_load`'s numbers in one line."""
    if not spread or "error" in spread:
        return spread.get("error", "(no MoE layers)")
    return (
        f"max/mean {spread['max_over_mean']:.2f} (worst layer {spread['worst_layer_max_over_mean']:.2f}), "
        f"min/mean {spread['min_over_mean']:.2f}, {100 * spread['unused_fraction']:.1f}% unused "
        f"over {spread['tokens']} tokens (uniform random routing: max/mean "
        f"{spread['uniform_random']['max_over_mean']:.2f})"
    )


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU x{os.cpu_count()}, {torch.get_num_threads()} torch threads"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    # The device machine's copy of the tree may carry a stale .git: ENCLAVE_COMMIT, when set, wins.
    if commit := engine_env().commit:
        return commit
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        )
        found = git.stdout.strip() if git.returncode == 0 else ""
    except OSError:
        found = ""
    return found or "unknown"


def print_table(report: dict[str, Any]) -> None:
    """The report as a table on stdout: a header of the run's setting, then a line per measurement."""
    c = report["configuration"]
    print(
        f"{report['machine']} | torch {report['torch']} | triton {report['triton']} | {c['dtype']} | "
        f"commit {report['commit']} | {c['source']} | kernels {c['kernels']}"
        + (f" | {c['quantization']} weights" if c.get("quantization", "none") != "none" else "")
        + (f" | KV {c['kv_cache_dtype']}" if c.get("kv_cache_dtype", "auto") != "auto" else "")
        + (f" | states {c['state_dtype']}" if c.get("state_dtype", "auto") != "auto" else "")
        + (" | quick" if c["quick"] else "")
    )
    print(
        f"roofline {report['bandwidth']['bytes_per_s'] / 1e9:,.0f} GB/s (copy) | matrix rate "
        f"{report['matmul']['flop_per_s'] / 1e12:,.2f} TFLOP/s | active params/token (batch 1) "
        f"{_count(c['params']['active_per_token_batch_1'])} of {_count(c['params']['total'])} | "
        f"expert load {load_text(report['expert_load'])}"
    )
    workloads = report["workloads"]
    print(f"{'workload':<28} {'tok/s':>10} {'MB/token':>10} {'roofline tok/s':>14} {'% roofline':>10}  notes")
    for letter, points in workloads.items():
        if isinstance(points, dict):  # skipped or failed as a whole
            print(f"({letter}) {points.get('skipped') or points.get('error')}")
            continue
        if letter in PEERS:
            continue
        for p in points:
            name = f"({letter}) {p['label']}"[:28]
            per_token = p.get("bytes_per_token", {}).get("total")
            note = _note(p)
            print(
                f"{name:<28} {_num(p.get('tokens_per_s'), ',.1f'):>10} "
                f"{_num(per_token and per_token / 1e6, ',.2f'):>10} "
                f"{_num(p.get('roofline_tokens_per_s'), ',.1f'):>14} "
                f"{_num(p.get('pct_of_roofline'), '.2f', '%'):>10}  {note}"
            )
    _print_peers({k: v for k, v in workloads.items() if k in PEERS and isinstance(v, list)})


def _print_peers(peers: dict[str, list[dict[str, Any]]]) -> None:
    """(h)-(j): total and output tok/s, wall time, and the ratio to vLLM's published figure."""
    if peers:
        print(
            f"{'vLLM-shaped workload':<28} {'total tok/s':>11} {'output tok/s':>12} {'wall s':>8} "
            f"{'vLLM H200':>16} {'vs vLLM':>8}  notes"
        )
    for letter, points in peers.items():
        peer = f"{PEERS[letter][2]:,.0f} {peer_metric(letter)}"
        for p in points:
            name = f"({letter}) {p['label']}"[:28]
            print(
                f"{name:<28} {_num(p.get('tokens_per_s'), ',.0f'):>11} "
                f"{_num(p.get('output_tokens_per_s'), ',.0f'):>12} {_num(p.get('wall_s'), ',.1f'):>8} "
                f"{peer:>16} {_num(p.get('vs_vllm'), '.2f', 'x'):>8}  {_note(p)}"
            )


def _note(p: dict[str, Any]) -> str:
    note = p.get("error") or p.get("skipped") or p.get("note", "")
    return note + (" (time cap)" if p.get("capped") and "time cap" not in note else "")


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
