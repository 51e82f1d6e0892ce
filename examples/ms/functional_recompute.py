# MindSpore's example of mindspore.recompute(block, *args), with only its imports changed:
# `mindspore` is `remat.ms` here. Run: python examples/ms/functional_recompute.py
import numpy as np
import remat.ms.nn as nn
from remat.ms import ops
from remat.ms import Tensor, recompute

class MyCell(nn.Cell):
    def __init__(self):
        super(MyCell, self).__init__(auto_prefix=False)
        self.conv = nn.Conv2d(2, 2, 2, has_bias=False, weight_init='ones')
        self.relu = ops.ReLU()

    def construct(self, x):
        y = recompute(self.conv, x)
        return self.relu(y)

inputs = Tensor(np.ones([2, 2, 2, 2]).astype(np.float32) * 2)
my_net = MyCell()
grad = ops.grad(my_net)(inputs)
print(grad)
