"""Tells a test which test its worker runs next, so that it can start that test's work ahead."""

import pytest

#: ``item.stash[NEXT_ITEM]``: the item this process runs after ``item`` (None after its last).
NEXT_ITEM = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Why: a module-scoped fixture only sees the collected items, and under pytest-xdist every
    worker collects them all, though it runs a share. pytest knows the item it runs next
    (xdist's workers too: they keep the next one queued), so work started for that item is
    work this worker will need."""
    item.stash[NEXT_ITEM] = nextitem


@pytest.fixture
def next_item(request):
    """The item this process runs after the requesting test (None after its last)."""
    return request.node.stash.get(NEXT_ITEM, None)
