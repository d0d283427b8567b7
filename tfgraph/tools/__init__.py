"""Sweeps over many models: the property-based fuzzer (``python -m tfgraph fuzz``) and the
Hugging Face architecture coverage run (``python -m tfgraph coverage``)."""
