"""torch.distributed.pipelining's zero-bubble I/W split re-runs custom autograd Functions and skips grad hooks.

    python docs/repros/pipelining_split_backward.py zbv          # I/W split (no dw_builder)
    python docs/repros/pipelining_split_backward.py interleaved  # one backward pass per micro-batch

Two stages per rank, 4 micro-batches: 8 backward calls of the custom Function are expected per rank.
torch 2.13 (CPU, gloo) prints 13 and 18 calls under ZBV and 0 post-accumulate-grad hooks on rank 1
(its weight gradients are assigned to `.grad` directly); interleaved 1F1B prints 9 and 10 calls (the
dynamic shape inference runs one real forward + backward per stage when no example shapes are given)
and 8 hooks.
"""
import os, sys, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble, ScheduleInterleaved1F1B

CALLS = {"backward": 0, "hook": 0}

class CountingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()
    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        CALLS["backward"] += 1
        return dy @ w, dy.t() @ x

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.w.register_post_accumulate_grad_hook(lambda p: CALLS.__setitem__("hook", CALLS["hook"] + 1))
    def forward(self, x):
        return CountingLinear.apply(x, self.w)

def main(rank, kind):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [Layer() for _ in range(4)]
    mine = [rank, 3 - rank] if kind == "zbv" else [rank, rank + 2]
    stages = [PipelineStage(layers[s], s, 4, torch.device("cpu")) for s in mine]
    cls = ScheduleZBVZeroBubble if kind == "zbv" else ScheduleInterleaved1F1B
    sched = cls(stages, n_microbatches=4, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, t = torch.randn(8, 8), torch.randn(8, 8)
    first = any(s.is_first for s in stages); last = any(s.is_last for s in stages)
    sched.step(*((x,) if first else ()), **({"target": t} if last else {}))
    print(f"{kind} rank {rank}: custom backward calls {CALLS['backward']} for 2 stages x 4 micro-batches = 8; "
          f"post-accumulate-grad hooks fired {CALLS['hook']}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
