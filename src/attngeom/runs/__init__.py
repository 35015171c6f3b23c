"""Runs: the runner (:mod:`.run`), its lock (:mod:`.lock`), torchrun (:mod:`.distributed`), the one experiment contract (:mod:`.contract`), atomic files (:mod:`.storage`)."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "ModelHandleLike": "contract",
    "RunLike": "contract",
    "ExperimentResult": "contract",
    "DistributedError": "distributed",
    "MANIFEST": "run",
    "merge_sums": "run",
    "InMemoryRun": "run",
    "read_manifest": "run",
    "verify": "run",
    "Run": "run",
})
