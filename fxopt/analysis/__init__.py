"""Analysis: from the captured joint fx graph to the solvers' torch-free `fxopt.solvers.Graph`.

  - `joint`: `analyze`, the whole translation (which node is forward or backward, its bytes,
    storage, cost, whether it may be recomputed).
  - `costs`: counted FLOPs and estimated seconds (`CostModel`).
  - `scratch`: memory an op allocates beyond its outputs, measured by running it.
  - `codecs`: which value may be COMPRESSed, with which codec (`Quantize` for lossy ones).
  - `storage`: tensors in a value and their storage bytes.
"""

from fxopt.analysis.costs import CostModel
from fxopt.analysis.joint import UNREAD_RESIDENT, JointGraph, analyze, graph_fingerprint

__all__ = ["CostModel", "JointGraph", "analyze", "graph_fingerprint", "UNREAD_RESIDENT"]
