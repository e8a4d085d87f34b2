import pytest

from sixfold.logs import read_metrics

from helpers import LONG, TINY, sixfold


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> float:
    """The final loss of a 30-step run on 2 ranks (LONG) that nothing stops."""
    run = tmp_path_factory.mktemp("whole")
    assert sixfold("train", TINY, f"log.run_dir={run}", *LONG).returncode == 0
    return read_metrics(run)[-1]["loss"]
