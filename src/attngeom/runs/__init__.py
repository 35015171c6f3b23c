"""Runs: the runner (:mod:`.run`), its lock (:mod:`.lock`), torchrun (:mod:`.distributed`), the one experiment contract (:mod:`.contract`), atomic files (:mod:`.storage`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "perplexity": "contract",
    "ModelHandleLike": "contract",
    "RunLike": "contract",
    "ExperimentResult": "contract",
    "window_records": "contract",
    "one_window_each": "contract",
    "layer_order": "contract",
    "per_window_array": "contract",
    "DistributedError": "distributed",
    "MANIFEST": "run",
    "CHECKPOINT": "run",
    "SETTINGS": "run",
    "OUTPUTS": "run",
    "MARKER": "run",
    "CHECKSUM": "run",
    "KINDS": "run",
    "SingleProcess": "run",
    "merge_sums": "run",
    "InMemoryRun": "run",
    "run_or_in_memory": "run",
    "fingerprint": "run",
    "versions": "run",
    "seal": "run",
    "unseal": "run",
    "read_manifest": "run",
    "verify": "run",
    "Run": "run",
})
