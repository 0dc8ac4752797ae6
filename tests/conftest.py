"""The tests' own cache: what a baseline release answered (the user's memo) and the
environments installed for it are kept per session, never in the user's ~/.cache."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    saved = os.environ.get("TPDP_VERIFY_CACHE")
    os.environ["TPDP_VERIFY_CACHE"] = str(tmp_path_factory.mktemp("tpdp-cache"))  # subprocesses inherit it
    yield
    if saved is None:
        os.environ.pop("TPDP_VERIFY_CACHE", None)
    else:
        os.environ["TPDP_VERIFY_CACHE"] = saved
