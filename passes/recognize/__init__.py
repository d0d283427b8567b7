"""Recognition: subgraphs rewritten into the canonical ops of the ``tfgraph`` domain (norms,
GELU; attention in :mod:`.attention`)."""
