"""Replicated state stays replicated: after training steps, every rank holding a copy of a tensor holds the same bits.

Parity tests compare rank 0 of a parallel run with one rank; they would not see another rank's copy drift from rank
0's (a gradient reduced over too small a group on some ranks, a selection bias moved by a rank's own expert loads),
and a checkpoint saves one rank's copy. Here every rank's weights, FP32 masters and AdamW moments (by the slice of a
parameter each holds), MoE selection biases and global expert loads, step counts and learning rate are all-gathered
and compared between the ranks that must agree, at one layout with data, tensor (sequence-parallel), and expert
parallelism together, and an MTP module."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from megafp8.config import load_config
from megafp8.model.moe import routers
from megafp8.optim import lr_at
from megafp8.parallel import ParallelDims, is_expert, tp_shard_of
from megafp8.train.trainer import Trainer
from tests.distributed import spawn
from tests.test_tensor_parallel import TP_MODEL

STEPS = 3
LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]  # 4 ranks: TP 2 x DP 2 (= EP 2)
MODEL = ["model.num_layers=3", "model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
         "model.vocab_size=512", "model.moe.ffn_hidden_size=256", "model.mtp_depth=1",
         "optimizer.bucket_size_mb=0.05"]  # several buckets: ZeRO shards that start and end inside parameters


def replicated_state(trainer: Trainer) -> dict[tuple, Any]:
    """This rank's copy of everything some other rank holds a copy of, by a key naming the copy: ranks holding the
    same key must hold the same value. A parameter's piece is its TP shard (if split over TP) and its experts (if
    routed experts); optimizer state is keyed by the parameter's elements this rank's ZeRO shard holds."""
    dims, opt = trainer.dims, trainer.optimizer

    def piece(p: torch.Tensor) -> tuple:
        return (dims.tp_rank if tp_shard_of(p) is not None else None, dims.ep_rank if is_expert(p) else None)

    state: dict[tuple, Any] = {("param", name, *piece(p)): p.detach().clone()
                               for name, p in trainer.model.named_parameters()}
    state.update({("buffer", name): b.clone() for name, b in trainer.model.named_buffers()
                  if name in trainer.model.state_dict()})
    for shard in opt.shards:
        for p, offset in zip(shard.bucket.params, shard.bucket.offsets):
            lo, hi = max(offset, shard.start), min(offset + p.numel(), shard.end)
            for attr in ("master", "exp_avg", "exp_avg_sq") if lo < hi else ():
                state[(attr, opt.names[p], *piece(p), lo - offset, hi - offset)] = \
                    getattr(shard, attr)[lo - shard.start : hi - shard.start].clone()
    state[("steps",)] = (trainer.step, opt.step_count, trainer.guard._counts.tolist())
    state[("lr",)] = lr_at(opt.step_count, trainer.cfg.optimizer, trainer.cfg.training.steps)
    for (name, _), load in zip(routers(trainer.model), trainer.expert_balance.loads):
        state[("global_load", name)] = load.clone()
    return state


def _expected_holders(key: tuple, dims: ParallelDims) -> int:
    """How many ranks hold a copy of `key` (one pipeline stage): all of them, or for a TP shard the DP replicas, for
    routed experts the TP ranks x expert-data-parallel replicas."""
    if key[0] in ("param", "master", "exp_avg", "exp_avg_sq"):
        tp_piece, ep_piece = key[2], key[3]
        holders = dims.world_size
        if tp_piece is not None:
            holders //= dims.tp
        if ep_piece is not None:
            holders //= dims.ep
        if key[0] != "param" and dims.dp > 1:  # ZeRO: one data-parallel rank (of the parameter's group) owns a slice
            holders //= dims.dp // dims.ep if ep_piece is not None else dims.dp
        return holders
    return dims.world_size


def _replicas_worker(rank: int, world: int, overrides: list[str]) -> None:
    cfg = load_config("tiny_moe_fp8", overrides)
    dims = ParallelDims.from_config(cfg.parallel)
    trainer = Trainer(cfg, dims, torch.device("cpu"))
    balance, local_loads = trainer.expert_balance, []
    rate = cfg.model.moe.bias_update_rate
    assert rate > 0 and dims.tp == 2 and dims.tensor_parallel.sp and dims.ep == 2 and dims.dp == 2

    def balancing(applied):  # the balancing hook, watched: this rank's own loads, and the bias update it makes
        local_loads.append(torch.stack([r.load.clone() for r in balance.routers]))
        before = [r.expert_bias.clone() for r in balance.routers]
        balance(applied)
        for router, bias, load in zip(balance.routers, before, balance.loads):
            assert torch.equal(router.expert_bias, bias + rate * torch.sign(load.mean() - load).to(bias.dtype))
    hooks = trainer.optimizer._post_step_hooks
    hooks[hooks.index(balance)] = balancing
    for _ in range(STEPS):
        trainer.train_step()

    every: list[Any] = [None] * world
    dist.all_gather_object(every, (replicated_state(trainer), local_loads))
    copies: dict[tuple, list[tuple[int, Any]]] = defaultdict(list)
    for r, (state, _) in enumerate(every):
        for key, value in state.items():
            copies[key].append((r, value))
    for key, held in copies.items():
        assert len(held) == _expected_holders(key, dims), (key, [r for r, _ in held])
        first_rank, first = held[0]
        for r, value in held[1:]:
            same = torch.equal(value, first) if isinstance(value, torch.Tensor) else value == first
            assert same, f"{key}: rank {r}'s copy differs from rank {first_rank}'s"
    assert every[0][0][("steps",)] == (STEPS, STEPS, [0, 0, 0])
    # Every step's selection bias moved by the global expert load: each rank's own counts summed over the ranks that
    # routed distinct tokens (every rank here: data-parallel replicas, and TP ranks under sequence parallelism), over
    # every micro-batch of the step, every assignment counted once.
    global_load = torch.stack([every[0][0][("global_load", name)] for name, _ in routers(trainer.model)])
    assert torch.equal(global_load, sum(loads[-1] for _, loads in every))
    # MTP depth k's router counts the T - k positions of each sequence that have a target (the main layers' all T)
    depths = [int(name.split(".")[1]) + 1 if name.startswith("mtp.") else 0 for name, _ in routers(trainer.model)]
    sequences, seq_len = cfg.training.global_batch_size, cfg.data.seq_len
    assert global_load.sum(dim=1).tolist() == [sequences * (seq_len - k) * cfg.model.moe.top_k for k in depths]
    biases = [value for key, value in every[0][0].items() if key[0] == "buffer" and key[1].endswith("expert_bias")]
    assert len(biases) == 3 and all(b.count_nonzero() > 0 for b in biases)  # two MoE layers and the MTP block's


def test_replicated_state_is_identical_on_every_rank_after_training(tiny_overrides):
    """DP x TP (sequence-parallel) x EP, FP8, the ZeRO-sharded optimizer: three steps, then every replicated tensor
    compared bit for bit across its holders (norms and routers over all four ranks; experts over TP; TP shards over
    DP; masters and moments slice by slice), and the selection biases checked against the global expert loads."""
    spawn(4, _replicas_worker, tiny_overrides + MODEL + LAYOUT + ["training.eval_interval=0"])


def _tp_copies_worker(rank: int, world: int, overrides: list[str], sp: bool) -> None:
    import logging

    cfg = load_config("tiny_dense", overrides + [f"parallel.sequence_parallel={str(sp).lower()}"])
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), torch.device("cpu"))
    trainer.train_step()
    state = trainer.checkpointer.model
    assert state.tp_replica_differences() == []  # every replicated weight the same on both TP ranks
    norm = dict(trainer.model.named_parameters())["final_norm.weight"]
    if rank == 1:  # one TP rank's copy drifts (a kernel that summed in another order there)
        with torch.no_grad():
            norm[3] = torch.nextafter(norm[3], torch.tensor(float("inf"), dtype=norm.dtype))
    assert state.tp_replica_differences() == ["final_norm.weight"]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megafp8").addHandler(handler)
    trainer.save()
    if trainer.run_lock is not None:  # (rank 0 holds it)
        trainer.run_lock.release()
    said = [r for r in records if "tensor-parallel ranks' copies of final_norm.weight differ" in r]
    assert len(said) == (1 if rank == 0 else 0), records
    advice = "this is a fault: please report it" if sp else "set parallel.sequence_parallel=true"
    assert all(advice in r for r in said), said


def test_a_checkpoint_save_says_where_tensor_parallel_copies_of_a_replicated_weight_differ(tiny_overrides,
                                                                                           tmp_path):
    """Without sequence parallelism a TP-replicated weight's gradient is never reduced over TP: its copies stay equal
    only where each TP rank computes the same bits (on GPUs, kernels chosen by timing, atomics, can differ), and a
    checkpoint holds one copy. Each save compares the copies' checksums and warns (once, on rank 0), naming them."""
    for sp in (False, True):
        spawn(2, _tp_copies_worker, tiny_overrides + TP_MODEL + ["parallel.tp=2", "training.eval_interval=0",
                                                      "checkpoint.format=full",
                                                      f"logging.output_dir={tmp_path / str(sp)}"], sp)
