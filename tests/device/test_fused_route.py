"""The fused route (SPEC §10, :mod:`attngeom.capture.routes`) on fake CUDA devices
(tests/fake_devices.py, as tests/device/test_fake_device.py runs the block path)."""

import pytest
import torch

from attngeom.capture import fused_winner
from attngeom.capture.session import Session
from attngeom.streaming.reducers import HeadStats, InputBatch, TokenStats
from test_fake_device import T, HostCopies, _fake_model, _forward

# the output projection's cache key reads parameters' data pointers, which fake tensors warn about
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")


def test_the_fused_route_copies_nothing_to_the_host_on_a_fake_gpu(monkeypatch):
    """bf16 on a fake ``cuda:0`` (tests/fake_devices.py): with ``route="auto"`` every layer takes the
    fused route (the memory-efficient kernel's forward and backward, no block), ``HeadStats`` and
    ``TokenStats`` add into sums on the device, and the forward copies nothing to the host. The
    winner's torch pass stands in for its Triton kernel, which fake tensors cannot launch."""

    monkeypatch.setattr(fused_winner, "uses_triton", lambda *a, **k: False)
    handle, cm = _fake_model("llama")
    try:
        ids = torch.randint(3, 100, (1, T))
        batch = InputBatch(ids=ids, lengths=torch.tensor([T]), index=[0])
        heads, tokens = HeadStats(), TokenStats()
        for r in (heads, tokens):
            r.begin(batch)
        session = Session(observers=[heads, tokens])
        with HostCopies() as counter:
            _forward(handle, session, ids)
        assert counter.copies == 0
        assert set(session.routes.values()) == {"fused"} and len(session.routes) == handle.num_layers
        for layer in session.routes:
            assert heads.sums[layer]["entropy"].device.type == "cuda"
            assert tokens._acc[layer]["_source"].device.type == "cuda"
    finally:
        cm.__exit__(None, None, None)
