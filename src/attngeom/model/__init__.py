"""Model access: loading, the handle, the architecture adapter, device/dtype policy, the GGUF cache.

* :mod:`.loading` — :func:`load_model` and the spec forms it accepts.
* :mod:`.handle` — :class:`ModelHandle` (model, tokenizer, ``adapter``, readable tokens).
* :mod:`.adapter` — :class:`ArchitectureAdapter`: attention modules, decoder layers, ``W_O``, ``W_V``
  and head geometry by attention layer, found by :func:`.adapter.discover` (a probe forward, no
  per-model code); :data:`SUPPORTED_ARCHITECTURES` (the types tests/models/test_architectures.py verifies).
* :mod:`.bundled` — :data:`BUNDLED_MODELS` (``smollm2-135m``, ``gemma3-270m``).
* :mod:`.gguf_cache` — GGUF dequantisation and the float safetensors cache.
* :mod:`.device` — :func:`resolve_device` / :func:`check_device` and :func:`resolve_dtype`; imports
  torch only, so commands can check ``--device`` and ``--dtype`` before anything heavy is imported.

Names are imported on first use, so ``from attngeom.model import check_device`` does not import
transformers.
"""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    # loading
    "load_model": "loading",
    "wrap": "loading",
    "DEFAULT_MODEL": "loading",
    "ACCEPTED_SPECS": "loading",
    "check_weights": "loading",
    # handle
    "ModelHandle": "handle",
    # adapter
    "ArchitectureAdapter": "adapter",
    "HeadGeometry": "adapter",
    "SUPPORTED_ARCHITECTURES": "adapter",
    "adapter_for": "adapter",
    "check_supported": "adapter",
    # bundled models
    "BUNDLED_MODELS": "bundled",
    "BundledModel": "bundled",
    "find_bundled": "bundled",
    # the float cache
    "cache_dir": "gguf_cache",
    # device and dtype policy
    "resolve_device": "device",
    "check_device": "device",
    "resolve_dtype": "device",
    "DTYPE_NAMES": "device",
})
