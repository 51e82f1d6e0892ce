import torch

import remat
from remat.models.gpt import GPT, GPTConfig

torch.manual_seed(0)
model = GPT(GPTConfig(layers=8, width=128, heads=4, seq_len=128, vocab=512))
tokens = torch.randint(0, 512, (8, 128))

plan = remat.plan(model, tokens, budget="60%")   # of the peak without recompute
print(plan)
plan.apply(model)                                 # marks the blocks as the table says
