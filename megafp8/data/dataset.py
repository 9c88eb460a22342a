"""Packed fixed-length samples over a token stream, and the data-parallel, resumable loader.

Documents are concatenated (each ends with the end-of-document token) and cut into samples of
`seq_len + 1` tokens that overlap by one, so sample i gives inputs stream[i*T : i*T+T] and
targets shifted by one.

The loader walks a seeded permutation of the samples (`megafp8.data.order`), epoch after epoch.
Optimizer step s uses global positions [s*G, (s+1)*G) (G = global batch); data-parallel rank r
takes the r-th contiguous share and cuts it into micro-batches. So a run with D ranks and A
accumulation steps sees, per optimizer step, exactly the samples of a run with 1 rank and D*A
steps. The loader's position is the number of samples consumed; its state adds what the position
is valid for (the number of samples, the seed, the kind of order and the data's fingerprint).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from megafp8.config import ConfigError
from megafp8.data.indexed import TokenStream
from megafp8.data.order import ORDER_KINDS, PERMUTATION, PERMUTATION_LIMIT, feistel_order, order_kind, permutation

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, targets), each (B, T) int64


class DataPositionError(ConfigError):
    """A saved data position that does not fit this run's samples or order (other data, seq_len or seed, or data
    of other content: its fingerprint): a relaunch must not continue from it; a run started from a named checkpoint
    starts its data afresh."""

    def __init__(self, mismatch: str, fix: str = "resume with the same data (data.path, or data.paths and "
                                                  "data.weights), data.seq_len and data order seed (data.seed, else "
                                                  "training.seed)") -> None:
        super().__init__(f"{mismatch}: {fix}")
        self.mismatch = mismatch


class PackedDataset:
    def __init__(self, stream: TokenStream, seq_len: int, split: str = "") -> None:
        self.stream, self.seq_len = stream, seq_len
        self.num_samples = (stream.num_tokens - 1) // seq_len
        if self.num_samples <= 0:
            raise ConfigError(
                f"split '{split}' of {stream.meta.root} has {stream.num_tokens} tokens, fewer than data.seq_len + 1 = "
                f"{seq_len + 1}: "
                "lower data.seq_len or add data"
            )

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> np.ndarray:
        return self.stream.read(index * self.seq_len, self.seq_len + 1)

    def batch(self, indices: np.ndarray, epochs: np.ndarray | None = None) -> Batch:
        """The samples `indices` (`epochs`: the epoch each is read in, which one dataset's samples do not depend
        on; a mixture's do, `megafp8.data.blend`)."""
        return stack_batch([self.sample(int(i)) for i in indices])

    def where(self) -> str:
        return f"split '{self.stream.split}' of {self.stream.meta.root}"

    # What the loader's state records of the data, and how a saved record differs (`megafp8.data.indexed`).
    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.stream.fingerprint

    def tokenizer_difference(self, saved: dict[str, Any]) -> str | None:
        return self.stream.tokenizer_difference(tokenizer_record(saved))

    def fingerprint_difference(self, saved: dict[str, Any]) -> str | None:
        if "mixture" in saved:
            return f"it was read from a mixture of {len(saved['mixture'])} datasets (data.paths), this run reads one"
        return self.stream.fingerprint_difference(saved)


def stack_batch(samples: list[np.ndarray]) -> Batch:
    """(tokens, targets) of samples of seq_len + 1 tokens each."""
    rows = torch.from_numpy(np.stack(samples))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def tokenizer_record(saved: dict[str, Any]) -> dict[str, Any]:
    """The part of a saved data fingerprint that names its tokenizer (`tokenizer`, `vocab_size`): a mixture's first
    directory's, one tokenizer for them all (`megafp8.data.blend.read_metas`)."""
    return saved["mixture"][0] if saved.get("mixture") else saved


class Samples(Protocol):
    """What the loader reads: a `PackedDataset`, or a mixture of them (`megafp8.data.blend.TrainingMixture`)."""

    @property
    def seq_len(self) -> int:  # a whole sample's input tokens (`data.seq_len`): the loader's state records it
        ...

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray, epochs: np.ndarray | None = None) -> Batch: ...

    def where(self) -> str: ...

    @property
    def fingerprint(self) -> dict[str, Any]: ...

    def tokenizer_difference(self, saved: dict[str, Any]) -> str | None: ...

    def fingerprint_difference(self, saved: dict[str, Any]) -> str | None: ...


class SequenceShare:
    """The samples of `dataset` cut to the token `positions` of each sequence a context-parallel rank holds
    (`megafp8.parallel.context`): its tokens and their targets, in the rank's order. The order, positions in the
    data and the data's record are the dataset's own, so a loader's state does not depend on the layout."""

    def __init__(self, dataset: Samples, positions: torch.Tensor) -> None:
        self.dataset, self.positions = dataset, positions

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def seq_len(self) -> int:
        """The whole samples' length (not this rank's share of it): what the loader's state records."""
        return self.dataset.seq_len

    def batch(self, indices: np.ndarray, epochs: np.ndarray | None = None) -> Batch:
        tokens, targets = self.dataset.batch(indices, epochs)
        return tokens[:, self.positions], targets[:, self.positions]  # (indexing copies: contiguous already)

    def where(self) -> str:
        return self.dataset.where()

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.dataset.fingerprint

    def tokenizer_difference(self, saved: dict[str, Any]) -> str | None:
        return self.dataset.tokenizer_difference(saved)

    def fingerprint_difference(self, saved: dict[str, Any]) -> str | None:
        return self.dataset.fingerprint_difference(saved)


class DistributedLoader:
    """Yields this rank's micro-batches of each optimizer step; seeded, shuffled, resumable.

    `permutation_limit`: the largest split that a new run walks in numpy's permutation; larger ones use
    feistel-v1 (`megafp8.data.order`). A resumed run keeps the kind of order its checkpoint records."""

    def __init__(
        self,
        dataset: Samples,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        permutation_limit: int = PERMUTATION_LIMIT,
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size * dp_size")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.order_kind = order_kind(len(dataset), permutation_limit)
        self.consumed_samples = 0
        self._epoch_order: tuple[int, np.ndarray] | None = None  # the permutation kind's latest epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = None  # the old epoch's order is freed before the new one is built
            self._epoch_order = (epoch, permutation(len(self.dataset), self.seed, epoch))
        return self._epoch_order[1]

    def _indices(self, first: int, count: int) -> np.ndarray:
        """Dataset indices at global positions [first, first + count)."""
        n = len(self.dataset)
        positions = np.arange(first, first + count, dtype=np.int64)
        epochs, within = np.divmod(positions, n)
        if not self.shuffle:
            return within
        indices = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():  # a step spans one epoch, or two at an epoch's end
            here = epochs == epoch
            if self.order_kind == PERMUTATION:
                indices[here] = self._permutation(epoch)[within[here]]
            else:
                indices[here] = feistel_order(within[here], n, self.seed, epoch)
        return indices

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step."""
        share = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * share
        indices = self._indices(start, share)
        epochs = np.arange(start, start + share, dtype=np.int64) // len(self.dataset)
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [self.dataset.batch(indices[i : i + mbs], epochs[i : i + mbs]) for i in range(0, share, mbs)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "num_samples": len(self.dataset),
                "seq_len": self.dataset.seq_len, "order": self.order_kind, "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. The saved kind of order is kept (a state without one, written before
        feistel-v1 existed, walked the permutation), so a later change of the limit never reorders a run."""
        saved = state.get("fingerprint") or {}
        tokenizer_change = self.dataset.tokenizer_difference(saved)
        if tokenizer_change is not None:  # never resumed past, even from a named checkpoint: the embedding's rows
            spec = tokenizer_record(saved).get("tokenizer")  # would mean other text
            raise ConfigError(
                f"{tokenizer_change}: the model's token ids would mean other text; train on data preprocessed with "
                f"the checkpoint's tokenizer (tools/preprocess_data.py --tokenizer {spec}), or start without the "
                "checkpoint")
        if state["seed"] != self.seed:
            raise DataPositionError(
                f"the saved data-loader state is for {state['num_samples']} samples with seed {state['seed']}, but "
                f"this run has {len(self.dataset)} samples with seed {self.seed}"
            )
        # Samples of another length may be as many (a small split): position i would be other tokens. (A state
        # without the length, written before it was saved, is checked by the number of samples alone.)
        if state.get("seq_len", self.dataset.seq_len) != self.dataset.seq_len:
            raise DataPositionError(f"the saved data-loader state is for samples of data.seq_len {state['seq_len']}, "
                                    f"but this run's are {self.dataset.seq_len} tokens long")
        # Data preprocessed again (other documents, another tokenizer) may have as many samples: its fingerprint
        # tells. Data of another number of samples (documents added to the corpus, preprocessed again at its path)
        # is other data too, named by the shard that differs where the state has a fingerprint. A state without one
        # (written before fingerprints) is otherwise taken on trust.
        difference = self.dataset.fingerprint_difference(saved) if saved else None
        if state["num_samples"] != len(self.dataset):
            difference = difference or f"it had {state['num_samples']} samples, this data has {len(self.dataset)}"
        if difference is not None:
            raise DataPositionError(
                f"{self.dataset.where()} is not the data the saved data-loader state was read from ({difference})",
                fix="resume with the data the checkpoint was trained on, or name the checkpoint in "
                    "checkpoint.resume=PATH to train this data from its first sample")
        kind = state.get("order", PERMUTATION)
        if kind not in ORDER_KINDS:
            raise DataPositionError(f"the saved data-loader state walks a sample order '{kind}' that this version "
                                    f"does not know (it knows {', '.join(ORDER_KINDS)})",
                                    fix="resume with the megafp8 version that wrote the checkpoint")
        self.order_kind, self._epoch_order = kind, None
        self.consumed_samples = int(state["consumed_samples"])


WHOLE_SPLIT = -1  # training.eval_iters: every whole micro-batch of the validation split


def validation_micro_batches(eval_iters: int, micro_batch_size: int, num_samples: int) -> int:
    """How many micro-batches a validation pass reads: `eval_iters`, or for `WHOLE_SPLIT` every whole micro-batch
    of a split of `num_samples` (the last samples short of one left out; one, wrapping around, for a split smaller
    than a micro-batch)."""
    if eval_iters != WHOLE_SPLIT:
        return eval_iters
    return max(1, num_samples // micro_batch_size)


class MicroBatches(Sequence[Batch]):
    """Held-out micro-batches read from `dataset` as they are used: micro-batch m of the split holds its samples
    [m x B, (m + 1) x B) (wrapping around), for m in `micro_ids`. One at a time in memory: a pass over a whole split
    (`training.eval_iters: -1`) of millions of samples never holds them all (seq_len x 16 bytes each)."""

    def __init__(self, dataset: Samples, micro_batch_size: int, micro_ids: Sequence[int]) -> None:
        self.dataset, self.micro_batch_size, self.micro_ids = dataset, micro_batch_size, micro_ids

    def __len__(self) -> int:
        return len(self.micro_ids)

    def __getitem__(self, i: int) -> Batch:  # type: ignore[override]  (no slices)
        m, size = self.micro_ids[i], self.micro_batch_size
        return self.dataset.batch(np.arange(m * size, (m + 1) * size) % len(self.dataset))


def validation_batches(dataset: Samples, micro_batch_size: int, num_micro: int, dp_rank: int,
                       dp_size: int) -> MicroBatches:
    """This rank's part of the same `num_micro` held-out micro-batches (the first samples of the split, in
    order) at every evaluation: micro-batch m goes to rank m % dp_size, so the set is layout-independent."""
    return MicroBatches(dataset, micro_batch_size, range(dp_rank, num_micro, dp_size))


def lockstep_validation_batches(dataset: Samples, micro_batch_size: int, num_micro: int, dp_rank: int,
                                dp_size: int) -> tuple[MicroBatches, list[bool]]:
    """`validation_batches`, run in lockstep: every rank gets ceil(num_micro / dp_size) micro-batches, and whether
    each counts. Under expert parallelism each forward pass's all-to-alls pair with the other EP ranks' (a rank
    with one micro-batch fewer left its peers waiting in a collective); a rank short of the most runs micro-batch 0
    again, not counted."""
    own = range(dp_rank, num_micro, dp_size)
    short = -(-num_micro // dp_size) - len(own)  # 0 or 1
    return (MicroBatches(dataset, micro_batch_size, [*own] + [0] * short),
            [True] * len(own) + [False] * short)
