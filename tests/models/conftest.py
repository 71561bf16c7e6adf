"""Every detector test runs on one torch thread (the fixture lives in tests/conftest.py), on the device
named by TXSENTINEL_TEST_DEVICE (default cpu): `scripts/gpu_check.sh` runs this suite with it set to cuda,
so the contract is checked on the GPU with the very tests that specify it."""

import os

import pytest
import torch

from pipeline.bench.gpu_check import tf32

TEST_DEVICE = os.environ.get("TXSENTINEL_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _detector_tests_on_one_thread(one_torch_thread):
    yield


@pytest.fixture(autouse=True)
def _detector_tests_on_the_test_device():
    """Tensors and modules made without a device land on TEST_DEVICE (torch's default device). On cpu
    nothing is set: a default device wraps every torch call in a Python mode, which doubles the suite's time."""
    if TEST_DEVICE == "cpu":
        yield
        return
    if not torch.cuda.is_available():
        pytest.fail(f"TXSENTINEL_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device")
    # The contract's float32 tolerances are IEEE float32's. torch lets cuDNN use TF32 (10-bit mantissa)
    # by default, which puts the LSTM's cuDNN forward ~3e-4 from its float32 step: see docs/benchmarks.md, "On a GPU".
    before = torch.get_default_device()
    torch.set_default_device(TEST_DEVICE)
    with tf32(allowed=False):
        yield
    torch.set_default_device(before)
