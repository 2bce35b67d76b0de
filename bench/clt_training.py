"""A cross-layer transcoder against one transcoder per layer, trained the same way on the same
MLP rows of the workbench's demo model, judged as the CLT papers judge them.

    PYTHONPATH=. .venv/bin/python bench/clt_training.py [--steps 2000] [--k 16]

demo-gpt2 (4 layers, 128 wide, trained 90 s on local text; built once into the work folder) runs
over local text; every layer's MLP inputs and outputs are kept (engine.sae.clt_training.mlp_rows).
Both contenders are TopK with ``k`` features a layer per token (equal total L0 in training),
``expansion`` x 128 features a layer, Adam at the same rate, the same batches and steps:

* per-layer transcoders: miStudio's SAE trainer (engine.testing.tiny_saes.trained_transcoders);
* a CLT: engine.sae.clt_training.CltTrainer, saved as the JumpReLU it is at inference.

Reported on held-out rows: explained variance per layer, L0 per layer as each runs at inference,
and the next-token loss with every MLP replaced at once (clean, replaced, all MLPs zeroed, and the
fraction recovered), on held-out text.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("BENCH_WORK") or Path(tempfile.gettempdir()) / "mistudio-bench-attribution")


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.demo_training import train_demo_gpt2
    from engine.sae.clt_training import (
        CltTrainer,
        CltTrainingConfig,
        ce_loss_recovered_all_mlps,
        clt_explained_variance,
        clt_l0,
        layer_explained_variance,
        mlp_rows,
    )
    from engine.sae.training import l0
    from engine.testing.tiny_models import local_corpus
    from engine.testing.tiny_saes import trained_transcoders

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--expansion", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))

    folder = WORK / "demo-gpt2" / "model"
    if not (folder / "config.json").exists():
        train_demo_gpt2(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = local_corpus(600_000)
    batches = [torch.tensor([tokenizer(text)["input_ids"][:128]]) for text in texts]
    batches = [batch for batch in batches if batch.shape[1] > 8]
    train_batches, held_out = batches[:-60], batches[-60:]
    inputs, outputs = mlp_rows(model, train_batches)
    test_inputs, test_outputs = mlp_rows(model, held_out)
    width = int(model.config.hidden_size)
    print(f"{len(inputs):,} training rows, {len(test_inputs):,} held out; k {args.k}, "
          f"{args.expansion * width} features a layer, {args.steps} steps of 256")  # fmt: skip

    started = time.perf_counter()
    per_layer = trained_transcoders(model, train_batches, architecture="topk", k=args.k,
                                    expansion=args.expansion, steps=args.steps)  # fmt: skip
    per_layer_seconds = time.perf_counter() - started

    started = time.perf_counter()
    config = CltTrainingConfig(d_sae=args.expansion * width, k=args.k, lr=3e-3, batch_size=256,
                               steps=args.steps, warmup_steps=10)  # fmt: skip
    trainer = CltTrainer(config, sample_inputs=inputs[:8192], sample_outputs=outputs[:8192])
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        picked = torch.randint(len(inputs), (256,), generator=generator)
        trainer.step(inputs[picked], outputs[picked])
    clt = trainer.finish(inputs[:8192]).sae
    clt_seconds = time.perf_counter() - started

    with torch.no_grad():
        guesses = torch.stack([transcoder(test_inputs[:, at]) for at, transcoder in enumerate(per_layer)], 1)
    per_layer_ev = [round(float(value), 4) for value in layer_explained_variance(test_outputs, guesses)]
    per_layer_l0 = [round(l0(transcoder, test_inputs[:, at]), 2) for at, transcoder in enumerate(per_layer)]
    clt_layer_l0 = [round(value, 2) for value in clt_l0(clt, test_inputs)]
    clt_ev = clt_explained_variance(clt, test_inputs, test_outputs)
    ce_per_layer = ce_loss_recovered_all_mlps(model, held_out, per_layer)
    ce_clt = ce_loss_recovered_all_mlps(model, held_out, clt)
    header = f"{'':<12} {'train s':>8} {'L0 per layer':<28} {'EV per layer':<32} {'CE replaced':>11}"
    print(header, f"{'recovered':>9}")
    for name, seconds, features, ev, ce in (
        ("per-layer", per_layer_seconds, per_layer_l0, per_layer_ev, ce_per_layer),
        ("CLT", clt_seconds, clt_layer_l0, clt_ev, ce_clt),
    ):
        layers = f"{features!s:<28} {ev!s:<32}"
        print(f"{name:<12} {seconds:>8.1f} {layers} {ce['replaced']:>11.4f} {ce['recovered']:>9.3f}")
    print(f"clean CE {ce_clt['clean']:.4f}, every MLP zeroed {ce_clt['zero']:.4f}")


if __name__ == "__main__":
    main()
