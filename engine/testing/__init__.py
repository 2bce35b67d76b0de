"""Builders of tiny real models (random weights, a tokenizer trained on local text) for tests,
benchmarks and the demo; nothing is downloaded."""
