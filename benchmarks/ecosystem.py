"""Bytes kept for backward by Hugging Face (and torchvision-style) models, marked four ways.

For each model, built from a small config (no download), one forward of a training
step is measured with remat.memory.saved_bytes (exact: the storages alive for
backward once the loss is returned):

- unmarked;
- torch.utils.checkpoint on the same blocks: Hugging Face's own switch,
  ``model.gradient_checkpointing_enable()`` (for the ResNet, torch's checkpoint
  around each block);
- ``remat.apply(model, where="blocks")`` (MindSpore's cell rule: keeps the block's
  output operator result) and ``output_recompute=True``.

The gradients of the remat rows are checked against the unmarked run (bitwise;
GPT-2 through Hugging Face's switch differs in the last bits: its layers run
without a cache, and its keys then have another memory layout).

    OMP_NUM_THREADS=1 python benchmarks/ecosystem.py   # writes benchmarks/results/ecosystem.{md,json}
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import copy
import json
import pathlib
import warnings

import torch
import torch.utils.checkpoint as tuc
import transformers as tf

import remat
from remat.models import resnet

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BATCH, SEQ, WIDTH, LAYERS, VOCAB = 4, 128, 256, 4, 1024


def hf_models() -> dict:
    width = {"hidden_size": WIDTH, "intermediate_size": 4 * WIDTH, "num_attention_heads": 4}
    return {
        "GPT-2": tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4,
                                                  n_positions=SEQ, vocab_size=VOCAB)),
        "Llama": tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=LAYERS, num_key_value_heads=2,
                                                    max_position_embeddings=SEQ, vocab_size=VOCAB,
                                                    **width)),
        "BERT": tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=LAYERS, max_position_embeddings=SEQ,
                                                 vocab_size=VOCAB, **width)),
        "T5": tf.T5ForConditionalGeneration(tf.T5Config(num_layers=LAYERS // 2,
                                                        num_decoder_layers=LAYERS // 2, d_model=WIDTH,
                                                        d_kv=WIDTH // 4, num_heads=4, d_ff=4 * WIDTH,
                                                        vocab_size=VOCAB)),
        "ViT": tf.ViTForImageClassification(tf.ViTConfig(num_hidden_layers=LAYERS, image_size=64,
                                                         patch_size=4, num_labels=10, **width)),
    }


def hf_batch(name: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if name == "ViT":
        return {"pixel_values": torch.randn(BATCH, 3, 64, 64, generator=g),
                "labels": torch.randint(0, 10, (BATCH,), generator=g)}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    if name == "T5":
        batch["decoder_input_ids"] = ids
    return batch


def measure(model: torch.nn.Module, forward) -> tuple[int, list]:
    """Bytes kept by one forward, and the gradients of the step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    losses = []
    saved = remat.memory.saved_bytes(lambda: losses.append(forward(model)) or losses[-1])
    losses.pop().backward()
    return saved, [p.grad for p in model.parameters()]


class _TorchCheckpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.block, x, use_reentrant=False)


def torch_checkpoint_blocks(model: torch.nn.Module, names: list[str]) -> None:
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, _TorchCheckpointed(getattr(owner, child)))


def row(name: str, model: torch.nn.Module, forward, torch_switch) -> dict:
    model.train()
    with_torch, keep, output = (copy.deepcopy(model) for _ in range(3))
    blocks = remat.apply(keep, where="blocks")
    remat.apply(output, where="blocks", output_recompute=True)
    torch_switch(with_torch, blocks)
    plain, want = measure(model, forward)
    torch_bytes, _ = measure(with_torch, forward)
    keep_bytes, keep_grads = measure(keep, forward)
    out_bytes, out_grads = measure(output, forward)
    exact = all(torch.equal(a, b) for g in (keep_grads, out_grads) for a, b in zip(g, want))
    kinds = sorted({type(model.get_submodule(b)).__name__ for b in blocks})
    return {"model": name, "blocks": f"{len(blocks)} x {'/'.join(kinds)}", "unmarked": plain,
            "torch": torch_bytes, "remat": keep_bytes, "output_recompute": out_bytes,
            "exact": exact}


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    rows = []
    for name, model in hf_models().items():
        batch = hf_batch(name)

        def hf_switch(m: torch.nn.Module, blocks: list[str]) -> None:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        rows.append(row(name, model, lambda m, b=batch: m(**b).loss, hf_switch))
        print(rows[-1], flush=True)
    x = torch.randn(BATCH * 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    net = resnet((2, 2, 2, 2), width=16, class_num=10)
    rows.append(row("ResNet (2,2,2,2)", net, lambda m: m(x).sum(), torch_checkpoint_blocks))
    print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ecosystem.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "ecosystem.md").write_text(markdown(rows))


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        (
            "| model | blocks found by `where=\"blocks\"` | unmarked MiB | torch.utils.checkpoint "
            "MiB | remat MiB | remat output_recompute MiB | output_recompute / torch | "
            "gradients = unmarked |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['blocks']} | {mib(r['unmarked'])} | {mib(r['torch'])} | "
            f"{mib(r['remat'])} | {mib(r['output_recompute'])} | "
            f"{r['output_recompute'] / r['torch']:.2f}x | {'bitwise' if r['exact'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
