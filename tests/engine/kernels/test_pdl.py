"""Programmatic dependent launch: off where it cannot run, and the rule that keeps it correct holds in the
source (a kernel launched with `pdl_launch()` waits with `pdl_wait(PDL)` before anything else)."""

import ast
from pathlib import Path

import pytest

from engine.env import EnvError, reset_engine_env
from engine.kernels import pdl

KERNELS = Path(__file__).resolve().parents[3] / "engine" / "kernels"


def test_off_under_the_interpreter_and_by_switch(monkeypatch):
    # Where it could run: only the interpreter or the switch turns it off. Both are read once (engine.env).
    monkeypatch.setattr(pdl, "_supported", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("ENCLAVE_PDL", raising=False)
    reset_engine_env()
    assert pdl.pdl_launch() == {"PDL": False}
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("ENCLAVE_PDL", "0")
    assert pdl.pdl_launch() == {"PDL": False}  # still the values read first
    reset_engine_env()
    assert pdl.pdl_launch() == {"PDL": False}
    monkeypatch.setenv("ENCLAVE_PDL", "1")
    reset_engine_env()
    assert pdl.pdl_launch() == {"PDL": True, "launch_pdl": True}


def test_a_bad_switch_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("ENCLAVE_PDL", "off")
    reset_engine_env()
    with pytest.raises(EnvError, match="ENCLAVE_PDL must be 0 or 1"):
        pdl.pdl_enabled()


def test_on_only_where_supported(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ENCLAVE_PDL", raising=False)
    reset_engine_env()
    monkeypatch.setattr(pdl, "_supported", lambda: True)
    assert pdl.pdl_launch() == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_supported", lambda: False)
    assert pdl.pdl_launch() == {"PDL": False}


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if ast.unparse(target) == "triton.jit":
                    found[node.name] = node
    return found


def _imported_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """The `@triton.jit` functions a module imports by name from another engine.kernels module (moe.fp8
    launches moe.triton's grouped GEMMs)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.kernels."):
            path = KERNELS.parents[1] / (node.module.replace(".", "/") + ".py")
            if path.is_file():
                kernels = _jit_kernels(ast.parse(path.read_text()))
                found.update({a.asname or a.name: kernels[a.name] for a in node.names if a.name in kernels})
    return found


def _launches(tree: ast.Module) -> list[tuple[str, bool]]:
    """(kernel name, passes **pdl_launch()) for every `kernel[grid](...)` call."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            name = ast.unparse(node.func.value)
            uses = any(k.arg is None and ast.unparse(k.value) == "pdl_launch()" for k in node.keywords)
            out.append((name, uses))
    return out


SOURCES = sorted(p for p in KERNELS.rglob("*.py") if "reference" not in p.name and p.name != "pdl.py")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_pdl_kernels_wait_before_anything_else(path):
    tree = ast.parse(path.read_text())
    kernels = _jit_kernels(tree)
    with_pdl = {}
    for name, fn in kernels.items():
        params = [a.arg for a in fn.args.args]
        if "PDL" not in params:
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert ast.unparse(body[0]) == "pdl_wait(PDL)", f"{name}: pdl_wait(PDL) must come first"
        with_pdl[name] = fn
    imported = _imported_kernels(tree)
    for name, uses in _launches(tree):
        fn = kernels.get(name) or imported.get(name)
        if fn is not None:
            # Launched with PDL exactly when it waits: a kernel that does not wait must not start early.
            waits = "PDL" in [a.arg for a in fn.args.args]
            assert uses == waits, f"{path.name}: {name} launch and PDL parameter disagree"


def test_the_decode_chain_is_covered():
    """The kernels of a decode step all take part (one without would only cost its own overlap, but the
    list documents what was measured)."""
    covered = set()
    for path in SOURCES:
        for name, fn in _jit_kernels(ast.parse(path.read_text())).items():
            if "PDL" in [a.arg for a in fn.args.args]:
                covered.add(f"{path.parent.name}/{path.stem}:{name}")
    assert {
        "norm/triton:_rms_norm_kernel",
        "linear/triton:_linear_kernel",
        "linear/triton:_sum_splits_kernel",
        "deltanet_step/triton:_deltanet_step_kernel",
        "attention/triton:_paged_attention_kernel",
        "qk_norm_rotary/triton:_qk_norm_rotary_kernel",
        "moe/gemv:_gate_up_kernel",
        "moe/gemv:_down_kernel",
        "moe/triton:_route_kernel",
        "moe/combine:_combine_kernel",
        "norm/combine_triton:_combine_add_rms_norm_kernel",
    } <= covered
