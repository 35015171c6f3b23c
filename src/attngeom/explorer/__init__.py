"""The interactive explorer's data (:mod:`.data`): flows, top sources and head tables from a trace; its HTML is
:mod:`attngeom.reports.explore`."""

from attngeom._exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "ExploreData": "data",
    "flow": "data",
    "build": "data",
    "from_trace": "data",
    "ExploreSettings": "settings",
})
