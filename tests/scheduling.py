"""How `make test` spreads the suite over pytest-xdist workers (`-n N --dist loadgroup`): test by test, but
each folder or module in TOGETHER whole on one worker.

xdist's own loadgroup keeps tests marked `xdist_group` together through a suffix it appends to their node
ids, which pytest 9.2's node ids no longer take (xdist 3.8): the marks are ignored without a word. Grouping
by path needs no mark, and marks still group should xdist set the suffix again.
"""

from xdist.scheduler import LoadGroupScheduling

# The fuzz folder checks the inputs it fed in total, counted in one process (tests/fuzz/test_zz_total.py);
# the gateway's module shares one gateway and one worker, and scans for its canaries last; the service API's
# module shares one `enclave serve` and one worker per back-end; the session script's module records every
# step of benchmarks/h200_session.sh once, in a module fixture.
TOGETHER = (
    "tests/fuzz/",
    "tests/e2e/test_gateway.py",
    "tests/e2e/test_service_api.py",
    "tests/engine/test_session_script.py",
)


class FolderGroupScheduling(LoadGroupScheduling):
    """loadgroup, with each TOGETHER folder or module one work unit (units go to workers largest first)."""

    def _split_scope(self, nodeid: str) -> str:
        for folder in TOGETHER:
            if nodeid.startswith(folder):
                return folder
        return super()._split_scope(nodeid)
