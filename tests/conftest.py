import os

import pytest

from sixfold.logs import read_metrics

from helpers import LONG, TINY, sixfold


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may be absent (-o addopts="")
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for -n auto: one per core this process may use, at most 4 (many tests start several ranks each, and
    waiting ranks leave the cores to the other worker's)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> float:
    """The final loss of a 30-step run on 2 ranks (LONG) that nothing stops."""
    run = tmp_path_factory.mktemp("whole")
    assert sixfold("train", TINY, f"log.run_dir={run}", *LONG).returncode == 0
    return read_metrics(run)[-1]["loss"]
