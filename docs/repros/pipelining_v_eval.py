"""torch.distributed.pipelining: a V-shaped schedule (ZBV, DualPipeV) cannot run `eval()` (forward only).

    python docs/repros/pipelining_v_eval.py zbv        # fails: "can't steal_bwd_input if this stage doesn't
    python docs/repros/pipelining_v_eval.py dualpipev  #         have backward" (torch 2.13 CPU, gloo)
    python docs/repros/pipelining_v_eval.py 1f1b       # works
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules


def main(rank: int, kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29542")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    v_shaped = kind != "1f1b"
    layers = [nn.Linear(8, 8) for _ in range(4 if v_shaped else 2)]
    mine = [rank, 3 - rank] if v_shaped else [rank]
    stages = [PipelineStage(layers[s], s, len(layers), torch.device("cpu")) for s in mine]
    cls = {"zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV,
           "1f1b": schedules.Schedule1F1B}[kind]
    schedule = cls(stages if v_shaped else stages[0], n_microbatches=4, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    args, kwargs = ((x,) if first else ()), ({"target": target} if last else {})
    schedule.step(*args, **kwargs)  # training works
    print(f"rank {rank}: step ok", flush=True)
    try:
        schedule.eval(*args, **kwargs)
        print(f"rank {rank}: eval ok", flush=True)
    except Exception as err:  # noqa: BLE001 - the point of the repro
        print(f"rank {rank}: eval failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
    os._exit(0)  # the peer may be stuck in a receive after the failure


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(main, args=(sys.argv[1] if len(sys.argv) > 1 else "zbv",), nprocs=2)
