"""The engine: everything that touches a model, with no Django (usable from a notebook or a script).

Inspection, hub downloads, loading and the loaded-model registry; hook points and the one hook
runtime; extraction, dataset parsing and generation; the tiny-model kit under ``testing``.
The apps (``models_app``, ``activations``, ``generation``) call it; it never calls them.
torch and transformers are imported inside functions, so importing it is cheap.
"""
