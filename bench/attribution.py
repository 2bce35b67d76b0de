"""Attribution graphs: our engine against circuit-tracer 0.5 on the same graph, on this CPU.

Run in the benchmark environment (bench/requirements-circuits.txt):

    PYTHONPATH=. .venv-bench/bin/python bench/attribution.py [--quick]

The models: demo-gpt2 (the workbench's demo: a 4-layer, 128-wide GPT-2 trained for 90 s on local
text, 128-token context; trained here once into the work folder) and the kit's "small" GPT-2
geometry (4 layers, 256 wide, 256-token context, random weights), each with one BatchTopK
transcoder per layer (k 24, 4x; a JumpReLU at inference) trained here on its own MLP inputs and
outputs. Prompts of 64 and 127 tokens
on demo-gpt2 (all features), and of 256 tokens on the small model (at most 2,048 feature nodes).
The ``clt-`` cases replace every MLP of demo-gpt2 with one cross-layer transcoder instead (random,
JumpReLU, 4x per layer: engine.testing.tiny_saes.random_clt), read by circuit-tracer's own
``load_clt``: its CLT path against ours.

Each contender runs in a fresh process: it loads the model and transcoders, attributes a short
prompt once (warm-up), resets the peak resident memory (``/proc/self/clear_refs``), then times the
prompt's attribution (best of ``--repeats``) and reports the peak resident memory above what was
resident before. Both build the same graph (same batch size, same logit and feature settings;
the adjacency is checked equal within 1e-4 of each row's largest entry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

WORK = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "mistudio-bench-attribution")
BATCH_SIZE = 64
# The transcoders: BatchTopK with this many features per token on average (a JumpReLU at inference).
TRANSCODER_K = 24
CASES = {
    # name: (model, prompt tokens, max feature nodes)
    "demo-64": ("demo-gpt2", 64, None),
    "demo-127": ("demo-gpt2", 127, None),
    "small-256": ("small-gpt2", 256, 2048),
    "clt-demo-64": ("demo-gpt2", 64, 2048),
    "clt-demo-127": ("demo-gpt2", 127, 2048),
    # Long prompts: the kit's "small" Llama with a 4,096-token context, at most 2,048
    # feature nodes: memory should grow at most linearly in the prompt once the cap is reached.
    "long-128": ("long-llama", 128, 2048),
    "long-512": ("long-llama", 512, 2048),
    "long-2048": ("long-llama", 2048, 2048),
}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _prompt_tokens(tokenizer, n: int) -> list[int]:
    from engine.attribution import attribution_tokens
    from engine.testing.tiny_models import local_corpus

    text = " ".join(local_corpus(40_000 if n < 1000 else 200_000)[5:])
    tokens = attribution_tokens(tokenizer, text)
    return tokens[:n]


def prepare(name: str) -> Path:
    """The model folder and its transcoders (ours and circuit-tracer's layout), built once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.sae.formats import save_circuit_tracer_set
    from engine.testing.tiny_models import build_tiny_model, local_corpus
    from engine.testing.tiny_saes import trained_transcoders

    folder = WORK / name
    if (folder / "transcoders" / "config.yaml").exists():
        return folder
    if name == "demo-gpt2":
        from engine.demo_training import train_demo_gpt2

        train_demo_gpt2(folder / "model")
    elif name == "long-llama":
        import json as json_module

        build_tiny_model("llama", folder / "model", size="small", seed=0)
        config_path = folder / "model" / "config.json"
        config = json_module.loads(config_path.read_text())
        config["max_position_embeddings"] = 4096  # rotary positions: no weights to grow
        config_path.write_text(json_module.dumps(config, indent=2))
    else:
        build_tiny_model("gpt2", folder / "model", size="small", seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    batches = [torch.tensor([tokenizer(text)["input_ids"][:128]]) for text in local_corpus(400_000)[:1500]]
    transcoders = trained_transcoders(
        model, [b for b in batches if b.shape[1] > 1], architecture="batchtopk", k=TRANSCODER_K, steps=400
    )
    save_circuit_tracer_set(transcoders, folder / "transcoders", model_name=name, scan=name)
    from engine.sae.clt import save_clt
    from engine.testing.tiny_saes import random_clt

    save_clt(random_clt(model, activation="jumprelu", expansion=4, seed=1), folder / "clt")
    return folder


def run_one(contender: str, case: str, repeats: int) -> dict:
    """One contender on one case, in this process (see the module docstring)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model_name, n_tokens, max_features = CASES[case]
    folder = WORK / model_name
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    tokens = _prompt_tokens(tokenizer, n_tokens)
    assert len(tokens) == n_tokens, len(tokens)
    cross_layer = case.startswith("clt-")
    if contender == "ours":
        from engine.attribution import AttributionConfig, attribute
        from engine.sae.clt import load_clt
        from engine.sae.formats import load_circuit_tracer

        model = AutoModelForCausalLM.from_pretrained(folder / "model").eval()
        transcoders = (
            load_clt(folder / "clt") if cross_layer else load_circuit_tracer(folder / "transcoders")[0]
        )
        config = AttributionConfig(batch_size=BATCH_SIZE, max_feature_nodes=max_features)

        def go(ids):
            graph = attribute(model, transcoders, ids, config)
            return graph.adjacency, graph.n_features, len(graph.active_features)

    else:
        import peers

        n_layers = AutoModelForCausalLM.from_pretrained(folder / "model").config.num_hidden_layers
        if cross_layer:
            replacement = peers.load_circuit_tracer_clt(folder / "model", folder / "clt")
        else:
            replacement = peers.load_circuit_tracer(
                folder / "model", folder / "transcoders", n_layers=n_layers
            )
        from circuit_tracer import attribute as circuit_tracer_attribute

        def go(ids):
            graph = circuit_tracer_attribute(
                torch.tensor(ids), replacement, batch_size=BATCH_SIZE, max_feature_nodes=max_features
            )
            return graph.adjacency_matrix, len(graph.selected_features), len(graph.active_features)

    go(tokens[:16])
    baseline = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        adjacency, n_features, n_active = go(tokens)
        times.append(time.perf_counter() - start)
    peak = _rss_kib("VmHWM")
    save_file({"adjacency": adjacency.contiguous()}, WORK / f"{contender}-{case}.safetensors")
    return {
        "contender": contender,
        "case": case,
        "seconds": min(times),
        "peak_mib": (peak - baseline) / 1024,
        "feature_nodes": n_features,
        "active_features": n_active,
        "nodes": int(adjacency.shape[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the 64-token case only, one repeat")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="only these cases")
    parser.add_argument(
        "--contenders", nargs="+", choices=["ours", "circuit-tracer"], default=["ours", "circuit-tracer"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run", nargs=2, metavar=("CONTENDER", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(*args.run, args.repeats)))
        return
    from safetensors.torch import load_file

    cases = args.cases or (["demo-64"] if args.quick else list(CASES))
    repeats = 1 if args.quick else args.repeats
    for model_name in {CASES[case][0] for case in cases}:
        prepare(model_name)
    rows = []
    for case in cases:
        results = {}
        for contender in args.contenders:
            output = subprocess.run(
                [sys.executable, __file__, "--run", contender, case, "--repeats", str(repeats)],
                check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
            ).stdout  # fmt: skip
            results[contender] = json.loads(output.strip().splitlines()[-1])
        if "circuit-tracer" not in results:
            rows.append((case, results["ours"], None, None))
            continue
        ours = load_file(WORK / f"ours-{case}.safetensors")["adjacency"]
        theirs = load_file(WORK / f"circuit-tracer-{case}.safetensors")["adjacency"]
        scale = theirs.abs().amax(1, keepdim=True).clamp_min(1e-6)
        same = ours.shape == theirs.shape and bool(((ours - theirs).abs() / scale).max() <= 1e-4)
        rows.append((case, results["ours"], results["circuit-tracer"], same))
    print(f"{'case':<10} {'active':>7} {'nodes':>6} {'ours s':>8} {'ct s':>8} {'speed':>6} "
          f"{'ours MiB':>9} {'ct MiB':>8} same")  # fmt: skip
    for case, ours, theirs, same in rows:
        if theirs is None:
            print(f"{case:<10} {ours['active_features']:>7} {ours['nodes']:>6} {ours['seconds']:>8.2f} "
                  f"{'—':>8} {'—':>6} {ours['peak_mib']:>9.0f} {'—':>8} —")  # fmt: skip
            continue
        print(
            f"{case:<10} {ours['active_features']:>7} {ours['nodes']:>6} {ours['seconds']:>8.2f} "
            f"{theirs['seconds']:>8.2f} {theirs['seconds'] / ours['seconds']:>5.2f}x "
            f"{ours['peak_mib']:>9.0f} {theirs['peak_mib']:>8.0f} {same}"
        )


if __name__ == "__main__":
    main()
