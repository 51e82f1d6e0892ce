"""A Hugging Face model trained by ``transformers.Trainer``, recomputing with remat.

A tiny GPT-2 from a config (no download), a few steps of causal language modelling on
random tokens. ``remat.gradient_checkpointing_enable(model)`` is Hugging Face's own
switch with remat's engine; ``remat.apply(model, where="blocks")`` would mark the same
layers. Leave ``TrainingArguments(gradient_checkpointing=...)`` off: it would switch
torch's checkpoint on instead.

    python examples/hf_trainer.py [--steps 4]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import remat


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=256)
    model = GPT2LMHeadModel(config)
    layers = remat.gradient_checkpointing_enable(model)  # the one line
    print(f"recomputing {len(layers)} layers: {', '.join(layers)}")

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                                     learning_rate=1e-3, logging_steps=1, save_strategy="no",
                                     report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(64, 32, 256))
        result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"trained {result.global_step} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
