"""Conversion between megafp8 model weights and Hugging Face safetensors directories.

`hf_config.py` maps config.json to our ModelConfig and back (and refuses what has no exact equivalent); this module
moves the tensors: the Llama names of GQA models (Llama, Mistral; Qwen2's q/k/v biases, Qwen3's query/key norms;
Mixtral's experts and router under `block_sparse_moe`, Qwen3-MoE's under `mlp`), here, and the DeepSeek-V2/V3 names
of MLA models in `hf_deepseek.py`. Our fused QKV and gate/up weights (and Qwen2's fused QKV bias) are split into the
separate projections on export and fused again on import; RoPE uses the same "rotate half" layout as Hugging Face
Llama, so no permutation is needed there.

Import reads every tensor the model needs by name and then refuses any tensor of the file it did not read (a bias,
a layer the config does not declare), so nothing is dropped silently. `fp8=True` on export stores every GEMM weight
that is whole 128x128 tiles as E4M3 with block scales under `<name>_scale_inv` (the DeepSeek-V3 layout: the FP32
multiplier that dequantizes each block) and declares it in `quantization_config`, with the linears it left BF16 under
`modules_to_not_convert`; embeddings, norms, the LM head and the routers stay BF16/FP32. Import dequantizes such
weights (blocks at the edges may be partial, as DeepSeek ships its 576-row kv_a).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from megafp8.checkpoint.hf_config import HfModel, export_layout, hf_config, model_from_hf
from megafp8.checkpoint.hf_deepseek import check_mtp_copies, from_deepseek_tensors, mtp_note, to_deepseek_tensors
from megafp8.checkpoint.hf_tensors import HfTensors, bf16_linears, check_no_selection_bias, emitter
from megafp8.config import ConfigError, ModelConfig

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # of a checkpoint sharded into several safetensors files
CONFIG_FILE = "config.json"
_PLAIN = {  # ours -> Hugging Face Llama, per layer ({i}) or global
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attn.out_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
    "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_FUSED = {  # ours -> the Llama tensors it is the row-wise concatenation of
    "layers.{i}.attn.qkv_proj.weight": ("model.layers.{i}.self_attn.q_proj.weight",
                                        "model.layers.{i}.self_attn.k_proj.weight",
                                        "model.layers.{i}.self_attn.v_proj.weight"),
    "layers.{i}.attn.qkv_bias": ("model.layers.{i}.self_attn.q_proj.bias",  # Qwen2
                                 "model.layers.{i}.self_attn.k_proj.bias",
                                 "model.layers.{i}.self_attn.v_proj.bias"),
    "layers.{i}.mlp.gate_up_proj.weight": ("model.layers.{i}.mlp.gate_proj.weight",
                                           "model.layers.{i}.mlp.up_proj.weight"),
}
_ROUTER = "layers.{i}.mlp.router.weight"
_SELECTION_BIAS = "layers.{i}.mlp.router.expert_bias"


@dataclasses.dataclass(frozen=True)
class _MoeNames:
    """A GQA layout's names of a MoE layer: its router, and one tensor per expert for our stacked experts (experts,
    [gate; up] or down rows, in), by part."""

    router: str
    expert: str  # with {i}, {e} and {w}
    gate_up: tuple[str, str]
    down: tuple[str]

    def parts(self, template: str) -> tuple[str, ...]:
        return self.gate_up if template == _EXPERTS[0] else self.down


_EXPERTS = ("layers.{i}.mlp.experts.gate_up_proj.weight", "layers.{i}.mlp.experts.down_proj.weight")
_MOE_NAMES = {
    "mixtral": _MoeNames("model.layers.{i}.block_sparse_moe.gate.weight",
                         "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", ("w1", "w3"), ("w2",)),
    "qwen3_moe": _MoeNames("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts.{e}.{w}.weight",
                           ("gate_proj", "up_proj"), ("down_proj",)),
}


def _split_sizes(cfg: ModelConfig, ours: str) -> list[int]:
    head_dim, kv = cfg.attention.head_dim_for(cfg.hidden_size, cfg.num_heads), cfg.attention.kv_heads_for(cfg.num_heads)
    if "qkv" in ours:
        return [cfg.num_heads * head_dim, kv * head_dim, kv * head_dim]
    return [cfg.ffn_hidden_size, cfg.ffn_hidden_size]


def _templates(name: str) -> tuple[str, str | None]:
    """(template with {i}, layer index or None) of one of our names."""
    match = re.match(r"layers\.(\d+)\.(.*)", name)
    return (f"layers.{{i}}.{match.group(2)}", match.group(1)) if match else (name, None)


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, fp8: bool,
                  layout: str = "llama") -> dict[str, torch.Tensor]:
    """Our state dict (by our names) of a GQA model -> Llama / Qwen3 / Mixtral / Qwen3-MoE-named tensors."""
    out: dict[str, torch.Tensor] = {}
    emit = emitter(out, fp8)
    moe = _MOE_NAMES.get(layout)
    for name, tensor in state.items():
        template, layer = _templates(name)
        if template in _PLAIN:
            emit(_PLAIN[template].format(i=layer), tensor)
        elif template in _FUSED:
            for hf_template, piece in zip(_FUSED[template], torch.split(tensor, _split_sizes(cfg, template), dim=0)):
                emit(hf_template.format(i=layer), piece)
        elif moe is not None and template == _ROUTER:
            emit(moe.router.format(i=layer), tensor)
        elif moe is not None and template in _EXPERTS:
            parts = moe.parts(template)
            for e, w in enumerate(tensor):
                for part, piece in zip(parts, w.chunk(len(parts), dim=0)):
                    emit(moe.expert.format(i=layer, e=e, w=part), piece)
        elif moe is not None and template == _SELECTION_BIAS:
            check_no_selection_bias(name, tensor, "Mixtral" if layout == "mixtral" else "Qwen3-MoE")
        else:
            raise ConfigError(f"tensor '{name}' has no Hugging Face {layout} name")
    return out


def from_hf_tensors(get: HfTensors, expected: dict[str, tuple[int, ...]], cfg: ModelConfig,
                    layout: str = "llama") -> dict[str, torch.Tensor]:
    """Llama / Qwen3 / Mixtral / Qwen3-MoE-named tensors -> our state dict in FP32, for every name in `expected`
    (our names and shapes)."""
    ours: dict[str, torch.Tensor] = {}
    moe = _MOE_NAMES.get(layout)
    for name, shape in expected.items():
        template, layer = _templates(name)
        if template in _PLAIN:
            ours[name] = get(_PLAIN[template].format(i=layer))
        elif template in _FUSED:
            ours[name] = torch.cat([get(t.format(i=layer)) for t in _FUSED[template]], dim=0)
        elif moe is not None and template == _ROUTER:
            ours[name] = get(moe.router.format(i=layer))
        elif moe is not None and template in _EXPERTS:
            ours[name] = torch.stack([torch.cat([get(moe.expert.format(i=layer, e=e, w=w))
                                                 for w in moe.parts(template)]) for e in range(cfg.moe.num_experts)])
        elif moe is not None and template == _SELECTION_BIAS:
            ours[name] = torch.zeros(shape)  # Mixtral and Qwen3-MoE route without one
        else:
            raise ConfigError(f"tensor '{name}' has no Hugging Face {layout} name")
        get.check_shape(name, ours[name], shape)
    return ours


def untie_head(get: HfTensors, ours: dict[str, torch.Tensor]) -> None:
    """A tied model's head is its embedding (ours starts as a copy); a head tensor the file also holds must equal
    it."""
    embed = ours["embed.weight"]
    if "lm_head.weight" in get and not torch.equal(get("lm_head.weight"), embed):
        raise ConfigError("tie_word_embeddings=true, but the checkpoint's lm_head.weight differs from the embedding")
    ours["lm_head.weight"] = embed.clone()


PARTIAL = ".partial"  # the suffix of a file being written: renamed to its own name once whole
SHARD_BYTES = 5 * 2**30  # the largest safetensors file an export writes (DeepSeek ships ~4.3 GB shards)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, max_seq_len: int, out_dir: Path, fp8: bool,
            shard_bytes: int = SHARD_BYTES, token_ids: Optional[dict[str, Any]] = None) -> str:
    """Write config.json and the weights in the layout `cfg` converts to (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE,
    DeepSeek-V2 or -V3; `state` includes the routers' `expert_bias` buffers): one model.safetensors, or where the
    tensors exceed `shard_bytes`, model-0000i-of-0000n.safetensors files of at most that size (a tensor larger alone
    gets a file of its own) with model.safetensors.index.json, as Hugging Face saves them. `token_ids`:
    config.json's `bos_token_id`, `eos_token_id` and `pad_token_id` (each `null` where not given). Returns the
    layout's model_type.

    Each file is written under a `.partial` name and renamed once all are whole, config.json last, after the
    weight files an earlier export left in `out_dir` under other names are gone. So an export killed while it writes
    (a job's time limit over hundreds of GB) leaves an earlier export there as it was, not half-overwritten (the
    files are not flushed to disk first: a power loss is not covered)."""
    from safetensors.torch import save_file

    layout = export_layout(cfg)
    tensors = (to_deepseek_tensors(state, cfg, fp8, layout) if layout.startswith("deepseek")
               else to_hf_tensors(state, cfg, fp8, layout))
    config = hf_config(cfg, layout, max_seq_len, fp8, token_ids)
    if fp8:
        config["quantization_config"]["modules_to_not_convert"] = bf16_linears(tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.glob("*" + PARTIAL):  # of an export stopped midway, by the names only ours have
        if is_export_file(leftover.name[:-len(PARTIAL)]) or leftover.name == CONFIG_FILE + PARTIAL:
            leftover.unlink()
    files = shard_files(tensors, shard_bytes)
    mode = _new_file_mode()
    for file, names in files.items():
        save_file({name: tensors[name] for name in names}, str(out_dir / (file + PARTIAL)), metadata={"format": "pt"})
        os.chmod(out_dir / (file + PARTIAL), mode)  # safetensors writes 0600: others sharing the export could not read
    written = dict.fromkeys(files)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: file for file, names in files.items() for name in names}}
        (out_dir / (INDEX_FILE + PARTIAL)).write_text(json.dumps(index, indent=2))
        written[INDEX_FILE] = None
    (out_dir / (CONFIG_FILE + PARTIAL)).write_text(json.dumps(config, indent=2))
    # The renames take milliseconds, against the minutes to hours of writing before them; a kill among them can
    # still leave a mix (this export's first shards beside an earlier one's of the same names). Their order keeps
    # the common cases whole: the weights and index first, then the earlier export's weights under other names go
    # (a model.safetensors beside an index in between is refused by `_read_tensors`), then config.json.
    for file in written:
        (out_dir / (file + PARTIAL)).replace(out_dir / file)
    for stale in out_dir.iterdir():
        if is_export_file(stale.name) and stale.name not in written:
            stale.unlink()
    (out_dir / (CONFIG_FILE + PARTIAL)).replace(out_dir / CONFIG_FILE)  # last: the export is whole
    return layout


def _new_file_mode() -> int:
    """The mode `open` gives a new file here (0666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def is_export_file(name: str) -> bool:
    """Whether `name` is one of the weight files (or their index) an export writes."""
    return name in (WEIGHTS_FILE, INDEX_FILE) or SHARD_NAME.fullmatch(name) is not None


def shard_files(tensors: dict[str, torch.Tensor], shard_bytes: int) -> dict[str, list[str]]:
    """The file each tensor goes to, in order: all in model.safetensors where they fit in `shard_bytes`, else
    consecutive runs of at most `shard_bytes` each (a larger tensor alone) named as Hugging Face names shards."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups, 1)}


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter and persistent buffer of the model `cfg` describes, with its shape (built on the meta
    device)."""
    from megafp8.model import Transformer
    from megafp8.precision import PrecisionRecipe

    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 1, device=torch.device("meta"))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or one ConfigError saying that the file is not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not a valid JSON file ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a valid JSON object")
    return value


def _read_tensors(in_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `in_dir`'s model.safetensors or of the shards its index names. A tensor in two files, or not in
    the file the index places it in, is refused: which copy transformers would read is then unclear."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = in_dir / INDEX_FILE
    if index.is_file() and (in_dir / WEIGHTS_FILE).exists():
        raise ConfigError(f"{in_dir} holds both {WEIGHTS_FILE} and {INDEX_FILE}: one is left from another export; "
                          f"remove it (transformers reads {WEIGHTS_FILE})")
    weight_map = _read_json(index).get("weight_map") if index.is_file() else None
    if index.is_file() and not isinstance(weight_map, dict):
        raise ConfigError(f"{index} is not a valid safetensors index: it has no weight_map")
    tensors: dict[str, torch.Tensor] = {}
    holder: dict[str, str] = {}  # tensor -> the file it was read from
    for file in sorted(set(weight_map.values())) if weight_map else [WEIGHTS_FILE]:
        try:
            loaded = load_file(str(in_dir / file))
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(f"{in_dir / file} is not a readable safetensors file ({err})") from None
        for name in loaded:
            if name in holder:
                raise ConfigError(f"tensor '{name}' is in two files, {holder[name]} and {file}: which one is meant is "
                                  "unclear")
            holder[name] = file
        tensors.update(loaded)
    for name, file in (weight_map or {}).items():
        if holder.get(name) != file:
            raise ConfigError(f"{INDEX_FILE} places tensor '{name}' in {file}, but "
                              f"{holder[name] + ' holds it' if name in holder else 'no file holds it'}")
    return tensors


@dataclasses.dataclass
class Imported:
    """A Hugging Face checkpoint in our terms: the model config, the state in FP32 (the routers' `expert_bias`
    buffers included), one line per thing the user should know (e.g. MTP weights absent), and config.json's
    `max_position_embeddings` and token ids (`bos_token_id`, `eos_token_id`, `pad_token_id` where it gives them: no
    model setting holds these; the converter carries them to a later export)."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    layout: str
    notes: list[str]
    max_position_embeddings: Optional[int] = None
    token_ids: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_hf(in_dir: Path) -> Imported:
    """A Hugging Face directory (config.json + model.safetensors or a sharded index) of a supported model_type ->
    our model. Refuses, in one line, any config key or tensor that has no exact megafp8 equivalent."""
    config_path = in_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: expected a Hugging Face model directory")
    raw_config = _read_json(config_path)
    model: HfModel = model_from_hf(raw_config, str(config_path))
    get = HfTensors(_read_tensors(in_dir))
    cfg, notes = model.cfg, list(model.notes)
    if model.layout == "deepseek_v3":
        note = mtp_note(cfg, get)
        if note:
            cfg, notes = dataclasses.replace(cfg, mtp_depth=0), notes + [note]
    shapes = full_shapes(cfg)
    if model.tied:
        del shapes["lm_head.weight"]
    try:
        if model.layout.startswith("deepseek"):
            state = from_deepseek_tensors(get, shapes, cfg, model.layout, model.rope_interleave)
        else:
            state = from_hf_tensors(get, shapes, cfg, model.layout)
    except RuntimeError as err:  # torch.cat / torch.stack of tensors that disagree: not a config.json mismatch
        if not get.recent:
            raise
        raise get.unjoinable(err) from None
    if model.tied:
        untie_head(get, state)
    if model.layout == "deepseek_v3":
        check_mtp_copies(get, state, cfg)
    get.check_all_read()
    positions = raw_config.get("max_position_embeddings")
    return Imported(cfg, state, model.layout, notes, int(positions) if positions else None, token_ids(raw_config))


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(raw_config: dict[str, Any]) -> dict[str, Any]:
    """config.json's token ids that are ids (an int, or for `eos_token_id` a list of ints, as Llama 3.1 has)."""
    def is_id(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    return {key: value for key, value in raw_config.items() if key in TOKEN_ID_KEYS
            and (is_id(value) or isinstance(value, list) and value and all(is_id(v) for v in value))}
