"""Graph mode: the recompute pass on a compiled forward+backward graph (front end).

``remat.compile`` lives here; the pieces are private modules:

* ``_regions``: which forward nodes the marks ask to recompute;
* ``_partition``: copies them into backward and partitions the joint graph;
* ``_cse``: common-subexpression elimination after the copies;
* ``_dump``: MindSpore-style text dumps and Graphviz files;
* ``_backend``: the ``torch.compile`` backend;
* ``_compile``: ``remat.compile`` (imports the rest on first use).
"""

from remat._graph._compile import compile

__all__ = ["compile"]
