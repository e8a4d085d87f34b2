"""Expert parallelism's pieces: dispatch bytes and outputs against one process. Whole-run parity is in
test_parity.py, Mixtral interop in test_hf.py, bad layouts in test_config.py."""
import pytest

from helpers import torchrun


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_bytes_equal_the_formula_and_outputs_one_process(ep):
    proc = torchrun("expert_bytes.py", ep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("expert bytes OK") == ep
