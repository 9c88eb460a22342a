"""Sharded checkpoints with `torch.distributed.checkpoint`: every rank writes its own pieces in parallel.

    DIR/step_00000100/.metadata        DCP's index: each tensor's full shape and which file holds which box
    DIR/step_00000100/__<r>_0.distcp   rank r's pieces (tensors only)
    DIR/step_00000100/meta.pt          step, data position, loss scale, RNG, config (rank 0; no objects)
    DIR/step_00000100/checksums.json   size and xxh3_64 digest of each file above (rank 0, last)
    DIR/latest                         the name of the newest complete checkpoint

Tensors are stored by name at their full (unsharded) shapes: `model/<name>` (weights and buffers),
`optim/masters/<name>`, `optim/exp_avg/<name>`, `optim/exp_avg_sq/<name>`. A rank contributes boxes of
them (`megafp8.parallel.Placed`): its tensor-parallel shard (one box per fused part), its experts, and
the ranges of the ZeRO-sharded optimizer state it owns. Identical boxes from replicas are written once.
Loading asks for each rank's own boxes under its own layout, so a checkpoint written at one TP / PP /
EP / DP layout loads at any other: the resharding is DCP's read planning.

Safety: every file is hashed while it is written (`megafp8/checkpoint/integrity.py`); rank 0 gathers every
rank's digests and writes them as the manifest once every rank's files, the index and meta.pt are complete.
The directory is written under a private temporary name and renamed only then, and `latest` is replaced
atomically (`megafp8/checkpoint/local.py`). Loading never unpickles code: DCP's index is read
by an unpickler that admits only DCP's metadata classes and torch's dtypes, tensors with
`weights_only=True`.
"""
from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megafp8.checkpoint.integrity import FileRecord, HashingFileSystem, hashed_file, write_manifest
from megafp8.config import ConfigError
from megafp8.config.errors import torch_load_text
from megafp8.parallel.sharding import Piece, Placed

INDEX_FILE = ".metadata"
META_FILE = "meta.pt"
_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED_BUILTINS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's index from plain data only: DCP's metadata dataclasses, torch.Size and torch's dtypes,
    layouts and memory formats. Anything else (a function, a foreign class) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                            torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which a checkpoint index never "
                                     "holds: not loading it")


class SafeReader(FileSystemReader):
    """FileSystemReader whose index is read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / INDEX_FILE
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {self.path} has no index ({INDEX_FILE}): not a complete sharded "
                              "checkpoint") from None
        except Exception as err:  # truncated or foreign files raise several types
            raise ConfigError(f"checkpoint index {path} is corrupt or unsafe: {err}") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"checkpoint index {path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note on every one-process save: our intent
_PLAIN = {"flatten_state_dict": False, "flatten_sharded_tensors": False}  # our state dicts are flat already


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _item(fqn: str, placed: Placed, piece: Piece) -> WriteItem:
    offsets = torch.Size(piece.offsets)
    return WriteItem(
        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.values.shape),
                                    properties=TensorProperties.create_from_tensor(piece.values),
                                    size=torch.Size(placed.shape)))


class _PieceSavePlanner(DefaultSavePlanner):
    """Writes each rank's `Placed` pieces as DCP shards of the full tensors."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.placed: dict[str, Placed] = state_dict
        self.is_coordinator = is_coordinator
        self.by_index = {(fqn, tuple(piece.offsets)): piece.values
                         for fqn, placed in state_dict.items() for piece in placed.pieces}

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_item(fqn, placed, piece) for fqn, placed in self.placed.items()
                              for piece in placed.pieces])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        values = self.by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
        return values.detach().contiguous().cpu()


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads each rank's `Placed` pieces (views into its own buffers) from whatever boxes the checkpoint has."""

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.placed: dict[str, Placed] = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for fqn, placed in self.placed.items():
            if fqn not in stored:
                raise ConfigError(f"tensor '{fqn}' is missing from the checkpoint")
            if tuple(stored[fqn].size) != tuple(placed.shape):
                raise ConfigError(f"tensor '{fqn}' has shape {tuple(stored[fqn].size)} in the checkpoint but "
                                  f"{tuple(placed.shape)} in the model")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.values.shape) for p in placed.pieces]
            items += create_read_items_for_chunk_list(fqn, stored[fqn], chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        piece = self.placed[read_item.dest_index.fqn].pieces[read_item.dest_index.index]
        target = piece.values
        for d, (o, s) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(d, o, s)
        return target

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view: the values are already in place


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / INDEX_FILE).is_file()


def write_sharded(directory: Path, placed: dict[str, Placed], meta: Optional[dict[str, Any]],
                  group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank writes its pieces into `directory` (collective over `group`, default: the world), hashing them as
    it writes; the rank given `meta` (rank 0) then writes it and the manifest of every rank's files."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(str(directory))
    writer.fs = HashingFileSystem()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            dcp.save(placed, storage_writer=writer, planner=_PieceSavePlanner(**_PLAIN), process_group=group,
                     no_dist=not _distributed())
        except CheckpointException as err:  # DCP wraps each rank's failure: raise this rank's own (disk full...)
            raise first_failure(err) from None
    records = _gather_records(writer.fs.records, group)
    if meta is not None:
        with hashed_file(directory / META_FILE, records) as f:
            torch.save(meta, f)
        write_manifest(directory, records)


def _gather_records(own: dict[str, FileRecord], group: Optional[dist.ProcessGroup]) -> dict[str, FileRecord]:
    """Every rank's file records on the group's first rank (an empty dict elsewhere)."""
    if not _distributed():
        return dict(own)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: Optional[list[Any]] = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(own, gathered, dst=first, group=group)
    return {name: record for ranks in gathered or [] for name, record in ranks.items()}


def read_sharded(directory: Path, placed: dict[str, Placed]) -> dict[str, Any]:
    """Fill every piece of `placed` from the checkpoint (collective) and return its `meta.pt` (tensors and plain
    values only)."""
    meta_file = directory / META_FILE
    if not meta_file.is_file():
        raise ConfigError(f"checkpoint {directory} lacks {META_FILE}: not a complete megafp8 checkpoint")
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign files
        raise ConfigError(f"checkpoint file {meta_file} is corrupt or not a megafp8 checkpoint "
                          f"({torch_load_text(err)})") from None
    _load(directory, placed, no_dist=not _distributed())
    return meta


RESUME_EARLIER = "resume from an earlier checkpoint"  # a training run's way past a damaged checkpoint


def short_file_problem(directory: Path) -> Optional[str]:
    """The first shard file shorter than the bytes the checkpoint's index places in it (or missing), as one line."""
    try:
        metadata = SafeReader(str(directory)).read_metadata()
    except ConfigError as err:
        return str(err)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = getattr(info, "offset", 0) + getattr(info, "length", 0)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            return f"checkpoint file {file} is missing"
        if file.stat().st_size < size:
            return f"checkpoint file {file} has {file.stat().st_size} bytes, its index places {size}: it is truncated"
    return None


def _load(directory: Path, placed: dict[str, Placed], no_dist: bool, advice: str = RESUME_EARLIER) -> None:
    """DCP's load into `placed`, its failures turned into one ConfigError naming the checkpoint (and the shard file
    when one is short), ending with `advice`."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            dcp.load(placed, storage_reader=SafeReader(str(directory)), planner=_PieceLoadPlanner(**_PLAIN),
                     no_dist=no_dist)
    except ConfigError:
        raise
    except (CheckpointException, Exception) as err:  # DCP wraps every rank's failure (e.g. a truncated shard file)
        reason = _first_config_error(err)
        if reason:
            raise ConfigError(reason) from None
        short = short_file_problem(directory)
        if short:
            raise ConfigError(f"{short}; {advice}") from None
        cause = next(iter(_failures(err)), err)
        raise ConfigError(f"checkpoint {directory} could not be read ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}): a shard file is truncated "
                          f"or corrupt; {advice}") from None


def _failures(err: BaseException) -> list[BaseException]:
    """The exceptions DCP's CheckpointException carries, one per failed rank (each stored with its traceback)."""
    found = []
    for failure in (getattr(err, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(exc, BaseException):
            found.append(exc)
    return found


def first_failure(err: BaseException) -> BaseException:
    """The first failed rank's own exception inside DCP's CheckpointException (else `err`)."""
    return next(iter(_failures(err)), err)


def _first_config_error(err: BaseException) -> Optional[str]:
    """One of our own errors (a missing tensor, a shape) among the ranks' failures."""
    return next((str(e) for e in _failures(err) if isinstance(e, ConfigError)), None)


def read_full(directory: Path, advice: str = RESUME_EARLIER, keep: Callable[[str], bool] = lambda name: True,
              shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint whose name `keep` accepts, at its full shape, by name (one process, no
    process group): for conversion, inspection and consolidation. `shapes_only`: meta tensors (names, shapes and
    dtypes; nothing read). `advice` ends the error of a damaged checkpoint."""
    metadata = SafeReader(str(directory)).read_metadata()
    short = short_file_problem(directory)  # a damaged file is named even where none of its tensors is read
    if short:
        raise ConfigError(f"{short}; {advice}")
    placed, full = {}, {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "size") or not keep(fqn):
            continue
        full[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta" if shapes_only else "cpu")
        placed[fqn] = Placed(tuple(md.size), [Piece(tuple(0 for _ in md.size), full[fqn])])
    if not shapes_only:
        _load(directory, placed, no_dist=True, advice=advice)
    return full

