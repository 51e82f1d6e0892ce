import torch

import remat


class Block(torch.nn.Module):  # your model: any nn.Module with a repeated block
    def __init__(self, width=256):
        super().__init__()
        self.norm, self.up, self.down = (torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                         torch.nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


torch.manual_seed(0)
model = torch.nn.Sequential(*[Block() for _ in range(8)])
x = torch.randn(8, 64, 256)

before = remat.profile(model, x, repeat=0, label="no marks")  # one training step, measured
remat.apply(model, where="blocks")            # recompute every block in backward
after = remat.profile(model, x, repeat=0, label="marked")
print(before.compare(after, depth=0))
