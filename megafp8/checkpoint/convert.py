"""Checkpoint conversion and inspection behind `tools/convert_checkpoint.py`.

The conversions that publish a checkpoint (`import_hf`, `consolidate`, `shard`) hold the lock of a run's checkpoint
directory they write into (`lock_for_conversion`) for their whole length, however they are called: refused in one
line while a run trains there, and a run launched meanwhile refused in turn."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from megafp8.checkpoint.hf import SHARD_BYTES, load_hf, save_hf
from megafp8.checkpoint.loading import CONVERTING, load_checkpoint
from megafp8.checkpoint.local import ABANDONED, HF_SOURCE, fresh_temporary, publish, save_checkpoint, step_dir_name
from megafp8.checkpoint.lock import lock_for_conversion
from megafp8.checkpoint.sharded import INDEX_FILE, is_sharded_checkpoint, write_sharded
from megafp8.parallel.sharding import Piece, Placed
from megafp8.config import ConfigError, ModelConfig, describe_blocks
from megafp8.config.loader import config_to_dict, model_config_from_saved
from megafp8.data.dataset import tokenizer_record
from megafp8.data.tokenizer import HFTokenizer


def model_config_of(state: dict[str, Any]) -> ModelConfig:
    """The model config saved in a checkpoint, with the vocabulary size read off the embedding."""
    saved = state.get("config", {}).get("model")
    if not saved:
        raise ConfigError("the checkpoint holds no model config")
    cfg = model_config_from_saved(saved)
    return dataclasses.replace(cfg, vocab_size=int(state["model"]["embed.weight"].shape[0]))


def best_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """FP32 master weights when the checkpoint has them (more precise than the BF16 model copy), plus the
    model's buffers (the MoE routers' selection biases)."""
    masters = state.get("optimizer", {}).get("masters")
    if not masters:
        return state["model"]
    return {**{k: v for k, v in state["model"].items() if k not in masters}, **masters}


DEFAULT_MAX_POSITIONS = 4096


def max_positions_of(state: dict[str, Any]) -> tuple[int, str]:
    """config.json's `max_position_embeddings` for `state`, and where it came from."""
    imported = state.get(HF_SOURCE, {}).get("max_position_embeddings")
    seq_len = state.get("config", {}).get("data", {}).get("seq_len")
    if imported and (not seq_len or int(imported) >= int(seq_len)):  # (a fine-tune at a shorter context keeps it)
        return int(imported), "kept from the imported Hugging Face config"
    if seq_len:
        return int(seq_len), "the run's data.seq_len" + (f", above the imported config's {imported}" if imported else "")
    return DEFAULT_MAX_POSITIONS, "the checkpoint records no sequence length; a default"


def export_hf(checkpoint: Path, out_dir: Path, fp8: bool, shard_bytes: int = SHARD_BYTES,
              tokenizer: Path | None = None, eos_token: str | None = None) -> str:
    """A megafp8 checkpoint -> a Hugging Face directory (safetensors files of at most `shard_bytes`); returns the
    model_type it was written as and its `max_position_embeddings` with where that came from, and what it says of
    the tokenizer. With `tokenizer` (the tokenizer.json the run's data was made with; `eos_token` as
    tools/preprocess_data.py takes it), the export holds it (tokenizer.json, tokenizer_config.json) and config.json
    its end-of-text id, so that `AutoTokenizer` loads from the directory and generation stops where training's
    documents ended; a tokenizer of another vocabulary size than the run's data is refused. Token ids an imported
    model's config.json had are written back (the tokenizer's end-of-text id replaces its `eos_token_id`)."""
    state = load_checkpoint(checkpoint, advice=CONVERTING, tensors="weights")
    check_out_outside(checkpoint, out_dir)
    positions, source = max_positions_of(state)
    cfg = model_config_of(state)
    hf_tokenizer = None if tokenizer is None else _export_tokenizer(tokenizer, eos_token, state, cfg)
    token_ids = dict(imported_token_ids(state))
    if hf_tokenizer is not None:
        token_ids["eos_token_id"] = hf_tokenizer.eos_id
        if hf_tokenizer.bos_id is not None:  # the run's documents began with it
            token_ids["bos_token_id"] = hf_tokenizer.bos_id
    model_type = save_hf(best_weights(state), cfg, positions, out_dir, fp8, shard_bytes, token_ids)
    said = f"{model_type}; max_position_embeddings {positions}: {source}"
    if hf_tokenizer is None:
        return said
    bos = {} if hf_tokenizer.bos_token is None else {"bos_token": hf_tokenizer.bos_token}
    tokenizer_files = {TOKENIZER_FILE: Path(hf_tokenizer.spec).read_text(encoding="utf-8"),
                       TOKENIZER_CONFIG_FILE: json.dumps(
                           {"tokenizer_class": "PreTrainedTokenizerFast", **bos, "eos_token": hf_tokenizer.eos_token,
                            "model_max_length": positions, "clean_up_tokenization_spaces": False}, indent=2)}
    for name, text in tokenizer_files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return f"{said}; tokenizer {tokenizer}, {_token_ids_said(hf_tokenizer)}"


def _token_ids_said(tok: HFTokenizer) -> str:
    """The exported tokenizer's special tokens, and whether `AutoTokenizer` begins a text as training's documents
    began (its tokenizer.json's template adds the beginning-of-document token, or none where the data had none)."""
    said = f"eos_token {tok.eos_token!r} (id {tok.eos_id})"
    prefix = tok.template_prefix()
    if tok.bos_token is not None:
        said += f", bos_token {tok.bos_token!r} (id {tok.bos_id})"
        if prefix[:1] != [tok.bos_token]:
            said += (f"; the run's documents began with {tok.bos_token!r}, which the tokenizer.json's template does "
                     "not add: prepend it to a prompt when encoding")
    elif prefix:
        said += (f"; the tokenizer.json's template begins a text with {' '.join(prefix)}, which the run's documents "
                 "did not begin with: encode prompts with add_special_tokens=False")
    return said


TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"


def imported_token_ids(state: dict[str, Any]) -> dict[str, Any]:
    """The token ids of the config.json a checkpoint was imported from (`import_hf`), carried with it."""
    return state.get(HF_SOURCE, {}).get("token_ids", {})


def missing_tokenizer_note(checkpoint: Path) -> str:
    """What an export without `--tokenizer` lacks, and the tokenizer.json the checkpoint's data was made with (its
    metadata only is read)."""
    state = load_checkpoint(checkpoint, verify=False, advice=CONVERTING, tensors="shapes")
    trained_with = tokenizer_record(state.get("loader", {}).get("fingerprint", {})).get("tokenizer")
    hint = f" (the run's data was tokenized with {trained_with})" if trained_with not in (None, "byte") else ""
    eos = imported_token_ids(state).get("eos_token_id")
    ids = ("config.json's eos_token_id is null" if eos is None else
           f"config.json's eos_token_id is the imported model's ({eos})")
    return (f"no tokenizer written and {ids}: add --tokenizer FILE.json{hint} for AutoTokenizer to load the "
            "directory and generation to stop at the end of a document")


def _export_tokenizer(path: Path, eos_token: str | None, state: dict[str, Any], cfg: ModelConfig) -> HFTokenizer:
    """The tokenizer.json to export beside the checkpoint's weights, refused where it cannot be the one its run's
    data was made with (another vocabulary size than recorded) or holds ids beyond the model's vocabulary."""
    if path.suffix.lower() != ".json":
        raise ConfigError(f"--tokenizer {path}: give a Hugging Face tokenizer.json (the byte tokenizer has no "
                          "Hugging Face form)")
    recorded = tokenizer_record(state.get("loader", {}).get("fingerprint", {}))

    def check_vocabulary(tok: HFTokenizer) -> None:  # first: another tokenizer's end-of-document id says less
        if recorded.get("vocab_size") not in (None, tok.vocab_size):
            raise ConfigError(f"--tokenizer {path} has {tok.vocab_size} ids, but the run's data was tokenized with "
                              f"{recorded.get('tokenizer')} of {recorded['vocab_size']}: give the tokenizer.json the "
                              "data was made with")

    try:  # with the end-of-document token the data was made with (its id recorded; `tokenizer_of_data`)
        tok = HFTokenizer(str(path), eos_token, recorded.get("eos_id"), bos_id=recorded.get("bos_id"))
    except ConfigError:
        check_vocabulary(HFTokenizer(str(path), eos_token))
        raise
    check_vocabulary(tok)
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"--tokenizer {path} has {tok.vocab_size} ids, more than the model's {cfg.vocab_size} "
                          "embedding rows: give the tokenizer.json the run's data was made with")
    return tok


def import_hf(hf_dir: Path, out_root: Path) -> tuple[Path, ModelConfig, list[str]]:
    """A Hugging Face directory (see `megafp8.checkpoint.hf_config` for the model types) -> a megafp8 checkpoint at
    step 0 (fresh optimizer and data position) under `out_root`, holding its run's lock where it has one. Returns
    its path, the model config a run resuming from it needs (`checkpoint.resume=<path>`), and the lines the user
    should read (e.g. MTP weights absent)."""
    with lock_for_conversion(out_root):
        return _import_hf(hf_dir, out_root)


def _import_hf(hf_dir: Path, out_root: Path) -> tuple[Path, ModelConfig, list[str]]:
    imported = load_hf(hf_dir)
    cfg, weights = imported.cfg, imported.state
    buffers = {name for name in weights if name.endswith("router.expert_bias")}  # FP32 buffers, not parameters
    params = {name: t for name, t in weights.items() if name not in buffers}
    state = {
        "model": {name: t if name in buffers else t.to(torch.bfloat16) for name, t in weights.items()},
        # A fresh optimizer: no moments stored (a step-0 state loads them as zeros), 8 bytes a parameter of zeros
        # neither held here nor written.
        "optimizer": {"step": 0, "masters": params},
        "step": 0,
        "loader": {},
        "loss_scaler": {},
        "rng": {"torch": torch.get_rng_state()},
        "config": {"model": dataclasses.asdict(cfg)},
    }
    source = {"max_position_embeddings": imported.max_position_embeddings, "token_ids": imported.token_ids}
    if any(source.values()):
        state[HF_SOURCE] = {key: value for key, value in source.items() if value}
    notes = list(imported.notes)
    if (hf_dir / TOKENIZER_FILE).is_file():  # the model's ids mean this tokenizer's text: the data must use it
        notes.append(f"{hf_dir / TOKENIZER_FILE} is the model's tokenizer: tokenize the data it trains on with it "
                     f"(tools/preprocess_data.py --tokenizer {hf_dir / TOKENIZER_FILE}{_bos_option(hf_dir)})")
    check_destination(None, out_root, 0)
    return save_checkpoint(out_root, 0, state, keep_last=0, latest_back=False), cfg, notes


def _bos_option(hf_dir: Path) -> str:
    """` --bos-token T` where the directory's tokenizer.json begins a text with T (its template): the documents the
    model was trained on began so. Empty where it adds none, or where the file cannot be read as a tokenizer."""
    try:
        tok = HFTokenizer(str(hf_dir / TOKENIZER_FILE))
    except ConfigError:  # no end-of-document token of the usual names, or not a tokenizer.json: said elsewhere
        return ""
    bos = tok.template_bos()
    return "" if bos is None else f" --bos-token '{bos}'"


def model_settings(cfg: ModelConfig) -> str:
    """The whole model section of a run config for `cfg`, as YAML (every key, so no base config's value leaks in)."""
    return yaml.safe_dump({"model": config_to_dict(cfg)}, sort_keys=False)


def check_out_outside(checkpoint: Path, out: Path) -> Path:
    """Refuse an `out` that is the checkpoint converted, or inside it: what is written there is none of the files its
    manifest lists, and goes with it when a run prunes it (an export under a run's step_N). Returns the checkpoint's
    directory, resolved."""
    source = (checkpoint if checkpoint.is_dir() else checkpoint.parent).resolve()
    if out.resolve() == source or source in out.resolve().parents:
        raise ConfigError(f"--out {out} is inside the checkpoint {checkpoint} it converts: choose a directory outside "
                          "it")
    return source


def check_destination(checkpoint: Optional[Path], out_root: Path, step: int) -> None:
    """Refuse to publish a conversion of `checkpoint` (None: not a megafp8 one) as step `step` under `out_root` where
    it would delete another checkpoint or put one a run set aside back among a run's own: an existing `step_N` there
    that is not `checkpoint` itself (an in-place change of form replaces it; any other is deleted by the publish), or
    a `step_N.abandoned` converted into its own directory (under its `step_N` name it reads as the run's own: resumed
    by `auto` where a newer one fails to verify, kept by `keep_last` in place of the run's)."""
    source = None if checkpoint is None else check_out_outside(checkpoint, out_root)
    target = out_root / step_dir_name(step)
    if source is not None and ABANDONED.match(source.name) and out_root.resolve() == source.parent:
        raise ConfigError(f"{checkpoint} was set aside by a run that left its branch: converted into {out_root} it "
                          f"would be {target}, read as that run's own; choose another --out (to train from it, set "
                          f"checkpoint.resume={checkpoint})")
    if (target.exists() or target.is_symlink()) and (source is None or target.resolve() != source):
        raise ConfigError(f"--out {out_root} already holds {target.name}, another checkpoint, which this conversion "
                          "would delete: choose another --out, or delete it first")


def consolidate(checkpoint: Path, out_root: Path) -> Path:
    """Any checkpoint -> a one-file (`full`) checkpoint at the same step under `out_root` (holding its run's lock
    where it has one)."""
    with lock_for_conversion(out_root):
        state = load_checkpoint(checkpoint, advice=CONVERTING)
        check_destination(checkpoint, out_root, int(state["step"]))
        return save_checkpoint(out_root, int(state["step"]), state, keep_last=0, latest_back=False)


def shard(checkpoint: Path, out_root: Path) -> Path:
    """Any checkpoint -> a sharded (torch.distributed.checkpoint) one at the same step under `out_root` (holding its
    run's lock where it has one), written by this one process; it loads at any layout like one a run wrote."""
    with lock_for_conversion(out_root):
        return _shard(checkpoint, out_root)


def _shard(checkpoint: Path, out_root: Path) -> Path:
    state = load_checkpoint(checkpoint, advice=CONVERTING)
    step = int(state["step"])
    check_destination(checkpoint, out_root, step)
    placed = {}
    for prefix, tensors in [("model", state["model"])] + [(f"optim/{kind}", state["optimizer"].get(kind, {}))
                                                          for kind in ("masters", "exp_avg", "exp_avg_sq")]:
        for name, t in tensors.items():
            placed[f"{prefix}/{name}"] = Placed(tuple(t.shape), [Piece((0,) * t.ndim, t)])
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    meta["optimizer_step"] = int(state["optimizer"].get("step", 0))
    tmp = fresh_temporary(out_root, step)
    write_sharded(tmp, placed, meta)
    return publish(out_root, tmp, step, keep_last=0, latest_back=False)


def tensor_order(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key of a tensor name, numbers by value (`layers.2` before `layers.10`): the listing's order, the same for
    both forms (a sharded checkpoint's index holds the tensors in the order the ranks wrote them)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def skipped_steps_line(state: dict[str, Any]) -> list[str]:
    """The line on the steps with non-finite gradients skipped in a row when the checkpoint was saved (none where
    there were none): a run resumed from it stops that many skips sooner."""
    nonfinite = state.get("nonfinite") or {}
    if not nonfinite.get("skips_in_a_row"):
        return []
    limit = state.get("config", {}).get("training", {}).get("max_consecutive_skips", "?")
    return [f"non-finite steps: {nonfinite['skips_in_a_row']} skipped in a row from step "
            f"{nonfinite.get('first_skipped_step')} (the run stops at training.max_consecutive_skips={limit})"]


def describe(checkpoint: Path) -> str:
    state = load_checkpoint(checkpoint, advice=CONVERTING, tensors="shapes")  # lists tensors, reads none
    config = state.get("config", {})
    if is_sharded_checkpoint(checkpoint):
        files = sorted(checkpoint.glob("*.distcp"))
        form = (f"sharded (torch.distributed.checkpoint: {len(files)} shard file(s), "
                f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB, index {INDEX_FILE})")
    else:
        form = "full (one state.pt)"
    lines = [f"checkpoint {checkpoint}", f"form: {form}", f"step: {state['step']}"]
    if config.get("model"):
        m = model_config_of(state)
        lines.append(f"model: {describe_blocks(m)}, vocab {m.vocab_size}")
    for section in ("parallel", "precision", "optimizer"):
        if config.get(section):
            keys = {k: v for k, v in config[section].items() if not isinstance(v, (list, dict))}
            lines.append(f"{section}: " + ", ".join(f"{k}={v}" for k, v in list(keys.items())[:8]))
    if state.get("loader"):
        lines.append(f"data position: {state['loader'].get('consumed_samples')} samples consumed")
    if state.get("loss_scaler"):
        lines.append(f"loss scale: {state['loss_scaler'].get('scale')}")
    lines += skipped_steps_line(state)
    optimizer = state.get("optimizer", {})
    lines += ["", "| tensor | shape | dtype | FP32 master | AdamW moments |", "|---|---|---|---|---|"]
    total = 0
    for name, tensor in sorted(state["model"].items(), key=lambda item: tensor_order(item[0])):
        total += tensor.numel()
        has_master = name in optimizer.get("masters", {})
        has_moments = name in optimizer.get("exp_avg", {})
        lines.append(f"| {name} | {tuple(tensor.shape)} | {str(tensor.dtype).removeprefix('torch.')} | "
                     f"{'yes' if has_master else 'no'} | {'yes' if has_moments else 'no'} |")
    lines.append(f"\n{len(state['model'])} tensors, {total / 1e6:.2f}M parameters, "
                 f"optimizer step {optimizer.get('step')}")
    return "\n".join(lines)
