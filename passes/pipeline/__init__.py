"""The pass pipelines: built for a target (:mod:`.build`), run with records, checks, dumps and
probes (:mod:`.run`), and the per-layer fusion report (:mod:`.fusions`)."""
