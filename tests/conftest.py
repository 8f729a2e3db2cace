"""Fixtures shared by every test folder."""

import pytest
import torch

@pytest.fixture(autouse=True)
def single_thread_torch():
    """Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine the
    threads' synchronisation made the suite ~15x slower (80 s instead of 5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
