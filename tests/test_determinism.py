"""train.deterministic: fixed-order kernels, which on a CPU train as the default ones do, bit for bit."""
import subprocess
import sys

import pytest
import torch

from sixfold.determinism import unsupported
from sixfold.logs import read_metrics
from helpers import ROOT, TINY, sixfold


def _python(code: str) -> str:
    """`code` run in a fresh process (the settings are the process's own), its output."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_setting_turns_every_switch():
    out = _python("""
import os, torch
from sixfold.determinism import make_deterministic
make_deterministic(compiled=True)
import torch._inductor.config as inductor
print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled(),
      os.environ["CUBLAS_WORKSPACE_CONFIG"], inductor.deterministic)
""")
    assert out.split() == ["True", "False", "True", "False", "False", ":4096:8", "True"]


def test_a_deterministic_run_trains_as_the_default_one_on_a_cpu(tmp_path):
    """The operations of tensor parallelism (the vocabulary-parallel loss), MoE routing and attention within
    documents all have fixed-order CPU kernels: none is refused, and nothing changes."""
    layout = ["parallel.tp=2", "model.moe_experts=4", "data.document_mask=true", "train.steps=3"]
    for name, extra in (("default", []), ("deterministic", ["train.deterministic=true"])):
        proc = sixfold("train", TINY, *layout, *extra, f"log.run_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [[m["loss"] for m in read_metrics(tmp_path / name)] for name in ("default", "deterministic")]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_an_operation_without_a_fixed_order_kernel_is_named_with_the_setting_to_change():
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as raised:
            torch.zeros(5).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
    finally:
        torch.use_deterministic_algorithms(False)
    said = unsupported(raised.value)
    assert said.startswith("train.deterministic=true, and put_ has no deterministic kernel on this device")
    assert "set train.deterministic=false" in said
    assert unsupported(RuntimeError("CUDA out of memory")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's attention backward adds atomically on a GPU")
def test_attention_backward_repeats_bit_for_bit_on_cuda():
    out = _python("""
import torch
from sixfold.determinism import make_deterministic
make_deterministic(compiled=False)
torch.manual_seed(0)
q, k, v = (torch.randn(2, 32, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
grads = []
for _ in range(2):
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ins, is_causal=True).float().square().sum().backward()
    grads.append([t.grad for t in ins])
print(all(torch.equal(a, b) for a, b in zip(*grads)))
""")
    assert out.split() == ["True"]
