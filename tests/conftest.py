"""Fixtures shared by the test modules."""

import os

import pytest
import torch

from tiny_models import tiny_model

TEST_DEVICE_ENV = "ATTNGEOM_TEST_DEVICE"
TEST_ORDER_ENV = "ATTNGEOM_TEST_ORDER"


TIERS = ("unit", "device", "integration", "models")
"""The folders of tests/ and the marker each gives its tests (docs/testing.md): ``device`` is the GPU
path on fake CUDA devices, kept out of ``unit`` so that the inner loop stays short."""


def pytest_collection_modifyitems(config, items):
    """Every test is marked with its tier (its folder: ``-m unit``, ``-m device``, ``-m integration``,
    ``-m models``).

    ``ATTNGEOM_TEST_ORDER=reverse`` or ``shuffle:SEED`` runs the tests in another order, to find
    tests that depend on what ran before them (module-scoped fixtures stay valid: pytest sets them
    up again where needed). Unset: pytest's own order."""
    for item in items:
        tier = next((t for t in TIERS if f"/tests/{t}/" in str(item.path).replace(os.sep, "/")), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    order = os.environ.get(TEST_ORDER_ENV, "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        import random

        random.Random(int(order.split(":", 1)[1])).shuffle(items)


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    """Where the device-agnostic tests run: ``$ATTNGEOM_TEST_DEVICE`` (default cpu; benchmarks/gpu_check.sh
    sets cuda). Asking for cuda on a machine without one fails the test with a clear message."""
    dev = torch.device(os.environ.get(TEST_DEVICE_ENV) or "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{TEST_DEVICE_ENV}={dev} but torch sees no CUDA device", pytrace=False)
    return dev


@pytest.fixture
def fifo(tmp_path):
    """A named pipe. A daemon thread opens its writing end after a few seconds and closes it, so
    code that wrongly opens it to read gets an empty file instead of blocking the tests forever."""
    import threading
    import time

    p = tmp_path / "pipe.txt"
    os.mkfifo(p)

    def unblock():
        time.sleep(5)
        os.close(os.open(p, os.O_WRONLY))

    threading.Thread(target=unblock, daemon=True).start()
    return p


@pytest.fixture
def dev_zero(monkeypatch):
    """``/dev/zero``, which never ends: opening it to read fails the test at once (instead of
    filling the memory of the machine)."""
    import builtins
    import io

    real = io.open

    def guarded(file, *args, **kwargs):
        if str(file) == "/dev/zero":
            raise AssertionError("/dev/zero was opened for reading")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", guarded)
    monkeypatch.setattr(builtins, "open", guarded)
    return "/dev/zero"


@pytest.fixture(scope="session")
def tiny_llama():
    """The tiny random Llama of ``tiny_model("llama")`` (3 layers, 4 query heads, 2 value heads), built
    once per session and shared: a test that changes it (its tokenizer, its device, a hook) builds its
    own with ``tiny_model``."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_llama):
    """:func:`tiny_llama` saved as a Hugging Face model directory (what ``--model DIR`` loads)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.model.save_pretrained(d)
    tiny_llama.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (``load_model("smollm2-135m")``), loaded once per session
    (the first load ever dequantises it into ``$ATTNGEOM_CACHE``). Tests that use it are marked
    ``slow`` and live in tests/models or tests/integration."""
    from attngeom import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: for bad input that a command must refuse before it loads one
    (every command loads through ``attngeom.commands.common.load``)."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded although the input is bad")

    monkeypatch.setattr("attngeom.commands.common.load", boom)
    monkeypatch.setattr("attngeom.model.load_model", boom)
