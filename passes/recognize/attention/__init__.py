"""Recognition of attention cores as ``tfgraph.Attention``: the rule families, one file each, and
the classification of masks and biases by evaluating them."""
