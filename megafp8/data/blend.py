"""A weighted mixture of several tokenized directories (`data.paths`, `data.weights`), read as one dataset.

Training: the mixture is one index space of N samples that the loader shuffles, epoch after epoch, exactly as it
shuffles one dataset's (`megafp8.data.dataset.DistributedLoader`). Dataset k owns a block of n_k = ceil(w_k x N)
indices, its weight's share, and in epoch e index o of its block reads its sample (e x n_k + o) mod L_k (L_k: its
samples): the dataset is read as one cycle that each epoch continues, so where a block is not whole passes over its
dataset, the samples read once more differ from epoch to epoch and every sample is read as often as the next over
the epochs (a fixed o mod L_k read the same first samples more, every epoch). N is the
smallest size at which no block is shorter than its dataset (N = max_k ceil(L_k / w_k)), so every epoch of the
mixture reads every sample of every dataset at least once, and a dataset weighted above its share of the tokens
is read several times an epoch (n_k / L_k). A step's samples are a uniform draw from the shuffled blocks, so each
dataset's share of them is its weight, up to the draw's noise. No weights: each dataset's share is its size, as
one corpus of them all.

Validation: every sample of every dataset's held-out split once, interleaved by weight (dataset k's o-th sample
at (o + 1/2) / w_k in a merged order), in order, so that the fixed first samples a validation pass reads hold
each dataset in proportion to its weight, the same set for any layout.

The loader's state records each dataset's fingerprint and the blocks, so a relaunch over other data or weights is
refused (`DataPositionError`) as for one dataset.
"""
from __future__ import annotations

import abc
import math
from fractions import Fraction
from typing import Any, Optional

import numpy as np

from megafp8.config import ConfigError
from megafp8.data.dataset import Batch, PackedDataset, stack_batch
from megafp8.data.indexed import META_FILE, DatasetMeta, read_meta


def read_metas(paths: list[str]) -> list[DatasetMeta]:
    """The metadata of each directory of a mixture; refused where their tokenizers cannot be one (another
    vocabulary size or end-of-document id: a token id would mean other text in one of them) or their documents
    begin otherwise (one with a beginning-of-document token, one without or with another)."""
    metas = [read_meta(path) for path in paths]
    first = metas[0]
    for meta in metas[1:]:
        if (meta.vocab_size, meta.eos_id) != (first.vocab_size, first.eos_id):
            raise ConfigError(
                f"data.paths mixes data of other tokenizers: {first.root / META_FILE} has {first.tokenizer} (vocab "
                f"{first.vocab_size}, end of document {first.eos_id}), {meta.root / META_FILE} has {meta.tokenizer} "
                f"(vocab {meta.vocab_size}, end of document {meta.eos_id}): tokenize every directory of the mixture "
                "with one tokenizer (tools/preprocess_data.py --tokenizer)")
        if meta.bos_id != first.bos_id:
            raise ConfigError(
                f"data.paths mixes documents that begin otherwise: {first.root / META_FILE} has {_beginning(first)}, "
                f"{meta.root / META_FILE} has {_beginning(meta)}: preprocess every directory of the mixture with the "
                "same --bos-token (or none)")
    return metas


def _beginning(meta: DatasetMeta) -> str:
    return "no beginning-of-document token" if meta.bos_id is None else f"beginning-of-document id {meta.bos_id}"


def exact_shares(weights: list[float], sizes: list[int]) -> list[Fraction]:
    """The datasets' shares, exactly: `weights` (each float's value) over their sum, or with none, `sizes` over
    theirs."""
    exact = [Fraction(w) for w in weights] or [Fraction(size) for size in sizes]
    total = sum(exact)
    return [w / total for w in exact]


MAX_SAMPLES = 2**62  # the most samples an epoch of a mixture may hold: its positions and orders are int64


def mixture_blocks(lengths: list[int], weights: list[float]) -> list[int]:
    """Each dataset's block n_k = ceil(w_k x N), N = max_k ceil(L_k / w_k) (module docstring), in exact rational
    arithmetic: in floats, w_k = L_k / sum(L) often gave blocks one longer than their datasets (a sample read twice
    an epoch, where no weights mean one corpus of them all)."""
    shares = exact_shares(weights, lengths)
    size = max(math.ceil(length / share) for length, share in zip(lengths, shares))
    return [math.ceil(share * size) for share in shares]  # each at least its dataset: w_k x N >= L_k


class _Mixture(abc.ABC):
    """Several packed datasets as one index space; a subclass says where index i lives (`_locate`)."""

    def __init__(self, datasets: list[PackedDataset], shares: list[float]) -> None:
        self.datasets, self.shares = datasets, shares
        self.seq_len = datasets[0].seq_len
        self.num_samples = 0

    def __len__(self) -> int:
        return self.num_samples

    @abc.abstractmethod
    def _locate(self, indices: np.ndarray, epochs: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within it) of each index (read in epoch `epochs`, where that matters)."""

    def batch(self, indices: np.ndarray, epochs: Optional[np.ndarray] = None) -> Batch:
        which, within = self._locate(np.asarray(indices, dtype=np.int64), epochs)
        return stack_batch([self.datasets[k].sample(int(j)) for k, j in zip(which.tolist(), within.tolist())])

    def where(self) -> str:
        return "the mixture of " + ", ".join(d.where() for d in self.datasets)


class TrainingMixture(_Mixture):
    """The training splits of a mixture, in blocks (module docstring); what the loader shuffles."""

    def __init__(self, datasets: list[PackedDataset], weights: list[float]) -> None:
        lengths = [len(d) for d in datasets]
        super().__init__(datasets, [float(share) for share in exact_shares(weights, lengths)])
        self.blocks = mixture_blocks(lengths, weights)
        self.lengths = np.array(lengths, dtype=np.int64)
        if sum(self.blocks) > MAX_SAMPLES:
            smallest = min(range(len(datasets)), key=lambda k: self.shares[k] / lengths[k])
            raise ConfigError(
                f"data.weights make an epoch of the mixture {sum(self.blocks):.3g} samples (every sample of "
                f"{datasets[smallest].where()}, weighted {self.shares[smallest]:.3g}, read once), more than the "
                f"{MAX_SAMPLES:.3g} its sample order can index: raise that directory's weight")
        self.block_starts = np.cumsum([0] + self.blocks)
        self.num_samples = int(self.block_starts[-1])

    def _locate(self, indices: np.ndarray, epochs: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        which = np.searchsorted(self.block_starts, indices, side="right") - 1
        lengths = self.lengths[which]
        within = (indices - self.block_starts[which]) % lengths
        if epochs is None:
            return which, within
        for epoch in np.unique(epochs).tolist():  # a step spans one epoch, or two at an epoch's end
            # Where epoch e's cycle starts in each dataset, (e x n_k) mod L_k, in Python's integers (no overflow);
            # then within + start < 2 L_k fits int64.
            starts = np.array([epoch * block % length for block, length in zip(self.blocks, self.lengths.tolist())],
                              dtype=np.int64)
            here = epochs == epoch
            within[here] = (within[here] + starts[which[here]]) % lengths[here]
        return which, within

    def reads_per_epoch(self) -> list[float]:
        """How many times an epoch of the mixture reads each dataset (its block over its samples)."""
        return [block / len(d) for block, d in zip(self.blocks, self.datasets)]

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {"mixture": [d.fingerprint for d in self.datasets], "blocks": list(self.blocks)}

    def tokenizer_difference(self, saved: dict[str, Any]) -> Optional[str]:
        # One tokenizer for the whole mixture (`read_metas`): the first dataset speaks for it.
        return self.datasets[0].tokenizer_difference(saved)

    def fingerprint_difference(self, saved: dict[str, Any]) -> Optional[str]:
        mixture = saved.get("mixture")
        if mixture is None:
            return f"it was read from one dataset, this run reads {self.where()}"
        if len(mixture) != len(self.datasets):
            return f"it mixed {len(mixture)} datasets, this run mixes {len(self.datasets)}"
        for dataset, was in zip(self.datasets, mixture):
            difference = dataset.fingerprint_difference(was)
            if difference is not None:
                return f"{dataset.where()}: {difference}"
        if list(saved.get("blocks", [])) != self.blocks:
            return (f"the mixture's blocks were {list(saved.get('blocks', []))} samples, are {self.blocks} "
                    "(other data.weights)")
        return None


class ValidationMixture(_Mixture):
    """The held-out splits of a mixture, every sample once, interleaved by weight (module docstring). The merged
    order is built for the prefix a validation pass reads, on first use: a held-out split of millions of samples
    costs nothing beyond the few a pass reads."""

    min_prefix = 1024  # the fewest entries built at a time

    def __init__(self, datasets: list[PackedDataset], weights: list[float]) -> None:
        lengths = [len(d) for d in datasets]
        super().__init__(datasets, [float(share) for share in exact_shares(weights, lengths)])
        self.num_samples = sum(lengths)
        self._which = self._within = np.empty(0, dtype=np.int64)

    def _prefix(self, count: int) -> None:
        """The first `count` entries of the merged order. Dataset k's o-th sample sorts after its first o, so the
        first `count` entries come from the first min(count, L_k) samples of each."""
        heads = [min(count, len(d)) for d in self.datasets]
        which = np.concatenate([np.full(n, k, dtype=np.int64) for k, n in enumerate(heads)])
        within = np.concatenate([np.arange(n, dtype=np.int64) for n in heads])
        shares = np.array(self.shares)
        order = np.lexsort((which, (within + 0.5) / shares[which]))[:count]  # by merged position, ties by dataset
        self._which, self._within = which[order], within[order]

    def _locate(self, indices: np.ndarray, epochs: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        needed = int(indices.max()) + 1 if len(indices) else 0
        if needed > len(self._which):  # grown geometrically: a pass over the whole split builds it a few times
            self._prefix(min(self.num_samples, max(needed, 2 * len(self._which), self.min_prefix)))
        return self._which[indices], self._within[indices]
