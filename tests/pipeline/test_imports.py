"""The pipeline's import structure: no import cycles among its modules (imports inside functions included,
as for engine/kernels: a cycle dodged by a function-level import still ties two modules together), and the
client's code paths import no torch, triton, SQLAlchemy or Celery (a client-only install lacks them)."""

import subprocess
import sys

from tests.engine.kernels.test_imports import ROOT, cycle, import_graph

PIPELINE = ROOT / "pipeline"
SERVICE_ONLY = ("torch", "triton", "sqlalchemy", "alembic", "celery", "kombu", "redis", "psycopg")
CLIENT_MODULES = (
    "pipeline.cli",
    "pipeline.client",
    "pipeline.api_client",
    "pipeline.results_files",
    "pipeline.gateway.server",
)


def test_no_import_cycles_in_pipeline():
    graph = import_graph(ROOT, PIPELINE)
    assert "pipeline.errors" in graph and "pipeline.client" in graph["pipeline.gateway.lifecycle"]
    found = cycle(graph)
    assert found is None, f"import cycle {' -> '.join(found)}: move what both need into a module of its own"


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


def test_client_modules_import_nothing_of_the_service_or_the_engine():
    """Imported in a fresh interpreter where the service's and the engine's packages cannot be imported
    (as in a client-only install), then `enclave --help` and `enclave submit --help` run."""
    blocked = ", ".join(repr(name) for name in SERVICE_ONLY)
    code = (
        "import sys\n"
        f"for name in ({blocked},): sys.modules[name] = None\n"
        f"for module in {CLIENT_MODULES!r}: __import__(module)\n"
        "from pipeline.cli import main\n"
        "assert main(['--help']) == 0 and main(['submit', '--help']) == 0\n"
        f"loaded = sorted(n for n in sys.modules if n.split('.')[0] in {SERVICE_ONLY!r} and sys.modules[n])\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
