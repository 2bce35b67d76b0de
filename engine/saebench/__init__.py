"""SAEs judged as SAEBench judges them (sae-bench 0.6.0's arithmetic), Django-free.

- :mod:`.methods` (torch-free): the methods, registered once (name, version, what they need, the
  columns a comparison shows);
- :mod:`.results` (torch-free): the core metrics' settings and results, and SAEBench's results JSON;
- :mod:`.core` (torch): the core metrics of an SAE spliced into a model;
- :mod:`.sparse_probing` (torch, scikit-learn): k-sparse probes on a labelled dataset.

Importing this package imports neither torch nor its torch modules: the web process reads
:mod:`.methods` and :mod:`.results`.
"""
