"""miStudio: a workbench for mechanistic-interpretability research on language models."""

__version__ = "0.1.0"
