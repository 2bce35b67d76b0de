"""Feature analysis of sparse autoencoders: the per-feature data of dashboards (``analysis``), what
decoder directions do (``decoder``: logit effects, nearest features), and which features fire on
a text (``inference``). No Django; importing ``analysis`` does not import torch."""
