"""Test-run ordering: the files marked ``pytestmark = pytest.mark.heavy`` (engines, CLI runs, whole mismatch runs:
tens of seconds a test) run first, each file's tests in their own order. Under pytest-xdist's ``--dist loadfile`` (the
test command's, with ``--no-loadscope-reorder``: xdist would otherwise order the files by their number of tests,
which puts the few-test vLLM files last) the workers then end on the many short files and finish together, instead
of one worker running a long vLLM file alone at the end."""

from __future__ import annotations


def pytest_collection_modifyitems(session, config, items):
    heavy = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path not in heavy:
            heavy[path] = item.get_closest_marker("heavy") is not None
    items.sort(key=lambda item: not heavy[item.nodeid.split("::", 1)[0]])      # stable: file order otherwise kept


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: a long-running test file (engines, CLI runs, whole mismatch runs): "
                                       "scheduled first, tests/conftest.py")
