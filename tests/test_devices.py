"""Every path on every device, checked without one: no tensor is created in the package without a device, work
sizes are chosen per kind of device (and can be chosen as a GPU would on this CPU), and the CUDA kernel that
returns the log-sum-exp is called with shapes its meta implementation accepts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lens_parallel import devices
from lens_parallel.attention import kernels
from lens_parallel.errors import LensParallelError

PACKAGE = Path(devices.__file__).parent
CREATORS = frozenset(
    {"zeros", "ones", "full", "empty", "arange", "tensor", "eye", "rand", "randn", "randint", "linspace", "randperm"}
)
"""``torch.<name>(...)`` calls that make a tensor on the default device unless told otherwise."""


def _device_less_creations(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in CREATORS
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_tensor_is_created_in_the_package_without_a_device():
    """A tensor made with ``torch.zeros(...)`` and no ``device=`` lands on the CPU while the model is on a GPU (how
    attribution failed on CUDA): every creation takes its device from its inputs (``x.new_*``, ``*_like``,
    ``device=x.device``) or says ``device="cpu"`` where host bookkeeping is meant."""
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _device_less_creations(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_device_less_creation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device=x.device)\nz = x.new_zeros(3)\n")
    assert _device_less_creations(bad, tmp_path) == ["bad.py:2: torch.zeros(3)"]


def test_work_sizes_follow_the_device_and_can_be_chosen_as_another_would():
    assert devices.kind("cpu") == "cpu" and devices.kind(torch.device("meta")) == "cpu"
    assert devices.sizes("cpu") is devices.SIZES["cpu"]
    cpu, cuda = devices.SIZES["cpu"], devices.SIZES["cuda"]
    for field in ("attention_elements", "fused_block", "scan_rows", "scan_bytes", "loss_chunk_bytes"):
        assert getattr(cuda, field) >= 8 * getattr(cpu, field), field  # a GPU: far fewer, larger blocks
    with devices.sized_as("cuda"):
        assert devices.kind("cpu") == "cuda" and devices.sizes("cpu") is cuda
    assert devices.kind("cpu") == "cpu"
    with (
        pytest.raises(
            LensParallelError, match="unknown device kind 'tpu' \\(did you mean 'cpu'\\?\\); accepted: cpu, cuda"
        ),
        devices.sized_as("tpu"),
    ):
        pass


@pytest.mark.parametrize("mask", [None, "broadcast", "per-row"])
def test_the_cuda_kernel_with_the_log_sum_exp_takes_these_shapes(mask):
    """On the meta device (shapes without data) the CUDA path runs as on a GPU: the memory-efficient kernel with
    compute_log_sumexp, its padded log-sum-exp cut to the queries, the mask copied into rows aligned to 16."""
    q = torch.empty(2, 4, 37, 64, device="meta")
    k = torch.empty(2, 4, 45, 64, device="meta")
    bias = {
        None: None,
        "broadcast": torch.empty(37, 45, device="meta"),
        "per-row": torch.empty(2, 1, 37, 45, device="meta"),
    }[mask]
    found = kernels.attention_with_lse(q, k, k, bias, causal=False, scale=0.125)
    assert found is not None
    out, lse = found
    assert out.shape == (2, 4, 37, 64) and lse.shape == (2, 4, 37)
    assert (
        kernels.attention_with_lse(q, k, torch.empty(2, 4, 45, 32, device="meta"), None, causal=False, scale=1.0)
        is None
    )
