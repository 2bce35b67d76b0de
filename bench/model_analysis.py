"""A feature analysis straight from the model against extracting a cache and analysing over it.

The same tokens both ways, through the engine functions the worker runs: (C) ``extract`` into a
``CacheWriter`` (the extraction job's path: batches of ``FORWARD_TOKENS`` tokens, pipelined
writes), then the three-pass ``analyze`` over the cache's store; (M) ``analyze`` over
``ModelRows``, which runs the model for the rows each pass reads and writes nothing. Reported:
seconds of each part, disk written, forward passes, and whether every array of the two analyses is
equal (it must be, exactly). The SAE is random (the sweep's cost does not depend on what it
learnt), ``expansion`` times the hook's width.

    .venv/bin/python bench/model_analysis.py [--model-dir DIR] [--samples 512] [--max-length 128]

Without ``--model-dir`` (or when it holds no trained model) demo-gpt2 is trained first (90 s).
``--model-dir /tmp/mistudio-real-model/gemma-3-270m`` runs it on Gemma 3 270M converted by the
real-model tests (``engine.testing.real_model``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORWARD_TOKENS = 4096  # saes.groups.FORWARD_TOKENS: tokens a forward pass reads


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / "data" / "local_models" / "demo-gpt2")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--layer", type=int, help="default: the middle block")
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the results here")
    arguments = parser.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from activations.store import ActivationStore, BackgroundWriter, CacheWriter, shard_tokens_for
    from engine.demo_training import demo_corpus, train_demo_gpt2
    from engine.extraction import extract, plan_batches, tokenize_samples
    from engine.features.analysis import AnalysisConfig, TokenTable, analyze, feature_arrays
    from engine.features.model_rows import ModelRows
    from engine.sae import SaeShape, SparseAutoencoder

    torch.manual_seed(0)
    scratch = Path(tempfile.mkdtemp(prefix="model-analysis-bench-"))
    try:
        folder = arguments.model_dir
        if not (folder / "config.json").exists():
            folder = scratch / "demo-gpt2"
            print("training demo-gpt2 (90 s)…", flush=True)
            train_demo_gpt2(folder, time_budget_seconds=90.0)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, dtype=torch.float32).eval()
        layers = model.config.num_hidden_layers
        hook = f"blocks.{arguments.layer if arguments.layer is not None else layers // 2}.hook_resid_post"
        width = model.config.hidden_size
        tokenized = tokenize_samples(tokenizer, demo_corpus()[: arguments.samples], arguments.max_length)
        plan = plan_batches([len(ids) for ids in tokenized], max(1, FORWARD_TOKENS // arguments.max_length))
        tokens = sum(map(len, tokenized))
        sae = SparseAutoencoder(SaeShape("standard", width, arguments.expansion * width))
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for name in ("W_enc", "W_dec"):
                weights = getattr(sae, name)
                weights.copy_(torch.randn(weights.shape, generator=generator) / width**0.5)
            sae.b_enc -= 0.5
        config = AnalysisConfig()

        def sweep(read_rows, table):
            token_table = TokenTable(table["token_ids"], table["sample_index"], table["position"])
            state = analyze(sae.encode, read_rows, token_table, d_sae=sae.shape.d_sae, config=config)
            return feature_arrays(state, token_table, config)

        # (C) extraction into a cache, then the analysis over it.
        directory = scratch / "cache"
        started = time.perf_counter()
        writer = CacheWriter.create_or_resume(
            directory, key={"bench": "model_analysis"}, provenance={}, hooks={hook: width}, dtype="float32",
            shard_max_tokens=shard_tokens_for({hook: width}, "float32"),
        )  # fmt: skip
        with BackgroundWriter(writer) as background:
            for batch in extract(model, tokenized, plan, hooks=[hook], dtype="float32"):
                background.add_extracted(batch)
        writer.finalize(num_samples=len(tokenized))
        writer.close()
        extraction_seconds = time.perf_counter() - started
        disk = folder_bytes(directory)
        store = ActivationStore.open(directory)
        started = time.perf_counter()
        over_cache = sweep(
            lambda start, stop: store.get(hook, start, stop, as_torch=True).float(), store.tokens()
        )
        cache_analysis_seconds = time.perf_counter() - started

        # (M) the analysis straight from the model.
        rows = ModelRows(model, tokenized, plan, hook=hook)
        started = time.perf_counter()
        from_model = sweep(lambda start, stop: rows.get(hook, start, stop).float(), rows.tokens())
        model_analysis_seconds = time.perf_counter() - started
        # NaN marks an empty context slot: equal where both are empty.
        equal = all(
            np.array_equal(from_model[name], over_cache[name], equal_nan=from_model[name].dtype.kind == "f")
            for name in over_cache
        )

        result = {
            "model": str(folder.name),
            "hook": hook,
            "d_sae": sae.shape.d_sae,
            "samples": len(tokenized),
            "tokens": tokens,
            "batches": len(plan),
            "cache": {
                "extraction_seconds": round(extraction_seconds, 2),
                "analysis_seconds": round(cache_analysis_seconds, 2),
                "total_seconds": round(extraction_seconds + cache_analysis_seconds, 2),
                "disk_bytes": disk,
            },
            "model_rows": {
                "analysis_seconds": round(model_analysis_seconds, 2),
                "forward_passes": rows.forward_passes,
                "disk_bytes": 0,
            },
            "arrays_equal": equal,
        }
        print(json.dumps(result, indent=1))
        print(
            f"\n{tokens:,} tokens of {folder.name} at {hook}, {sae.shape.d_sae:,} features: "
            "extract + analyse "
            f"{result['cache']['total_seconds']} s and {disk / 2**20:.1f} MiB on disk; from the model "
            f"{result['model_rows']['analysis_seconds']} s ({rows.forward_passes} forward passes of "
            f"{len(plan)} batches), nothing on disk; arrays equal: {equal}"
        )
        if arguments.json:
            arguments.json.write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
