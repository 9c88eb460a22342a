"""Reading and writing Hugging Face tensors: FP8 blocks, routers in FP32, and a reader that knows what it read."""
from __future__ import annotations

import re
from typing import Callable

import torch

from megafp8.config import ConfigError
from megafp8.precision.formats import E4M3, TILE
from megafp8.precision.quantize import quantize_128x128

# What FP8 export may quantize: the weights transformers holds in nn.Linear layers, lm_head aside (DeepSeek's kv_a is
# `kv_a_proj_with_mqa`).
_GEMM_NAMES = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")
_ROUTER_NAMES = ("gate.weight", "e_score_correction_bias")  # stay FP32, as DeepSeek ships them


def check_no_selection_bias(name: str, bias: torch.Tensor, layout: str) -> None:
    """Mixtral and DeepSeek-V2 route without a selection bias: export only a model whose biases are all zero."""
    if torch.any(bias != 0):
        raise ConfigError(f"{name} is non-zero (auxiliary-loss-free balancing), but the {layout} layout has no "
                          "selection bias: train such models with model.moe.bias_update_rate=0")


def emitter(out: dict[str, torch.Tensor], fp8: bool) -> Callable[[str, torch.Tensor], None]:
    """A function storing one Hugging Face tensor into `out`: routers FP32, GEMM weights of whole 128x128 tiles E4M3
    with `_scale_inv` blocks under `fp8`, everything else BF16."""
    def emit(name: str, t: torch.Tensor) -> None:
        if fp8 and name.endswith(_GEMM_NAMES) and t.ndim == 2 and t.shape[0] % TILE == 0 and t.shape[1] % TILE == 0:
            out[name], out[name + "_scale_inv"] = quantize_128x128(t.float(), E4M3)
        elif name.endswith(_ROUTER_NAMES):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return emit


def bf16_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The modules (Hugging Face names) of an FP8 export whose GEMM weights stayed BF16 (not whole 128x128 tiles),
    plus `lm_head`: `quantization_config.modules_to_not_convert`. FP8 loaders (transformers, vLLM) make every other
    linear an FP8 layer expecting an E4M3 weight and its `_scale_inv`; a BF16 weight there got an uninitialized scale.
    Experts are named by their `experts` module, which transformers (5) holds all of a layer's experts in."""
    kept = {re.sub(r"\.experts\.\d+\..*", ".experts", name.removesuffix(".weight")) for name, t in tensors.items()
            if name.endswith(_GEMM_NAMES) and t.dtype != torch.float8_e4m3fn}
    return ["lm_head"] + sorted(kept)


class HfTensors:
    """A checkpoint's tensors by Hugging Face name, read in FP32 (E4M3 ones dequantized with their `_scale_inv`
    blocks). It remembers what was read, so that a tensor nothing read can be refused."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.read = tensors, set()
        self.recent: list[str] = []  # read since the last `check_shape`: the sources of the tensor it checks

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ConfigError(f"tensor '{name}' is missing from the Hugging Face checkpoint")
        self.read.add(name)
        self.recent.append(name)
        value = self.tensors[name]
        if value.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return value.float()
        scale = self.tensors.get(name + "_scale_inv")
        if scale is None:
            raise ConfigError(f"FP8 tensor '{name}' has no '{name}_scale_inv' block scales")
        self.read.add(name + "_scale_inv")
        return _dequantize(name, value, scale.float())

    def check_shape(self, ours: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """`tensor` (our tensor `ours`, made of the tensors read since the last call), refused unless it has the shape
        the config describes: a config.json that does not match its weights would otherwise be imported, and the run
        resuming from it fail."""
        sources, self.recent = self.recent, []
        if tuple(tensor.shape) != tuple(shape):
            if len(sources) > 3:  # a layer's experts: hundreds
                sources = sources[:2] + [f"{len(sources) - 2} more"]
            raise ConfigError(f"tensor '{ours}' (from {', '.join(sources)}) has shape {tuple(tensor.shape)}, but "
                              f"config.json describes {tuple(shape)}: the config does not match the weights")
        return tensor

    def unjoinable(self, err: RuntimeError) -> ConfigError:
        """The error for torch failing (`err`) to join the tensors read since the last `check_shape` into one of ours
        (q/k/v, gate/up, a layer's experts): their shapes disagree among themselves, which no config.json explains."""
        sources, self.recent = self.recent, []
        listed = [f"{name} {tuple(self.tensors[name].shape)}" for name in sources[:4]]
        more = f" and {len(sources) - 4} more" if len(sources) > 4 else ""
        return ConfigError(f"the checkpoint's tensors {', '.join(listed)}{more} cannot be joined into one megafp8 "
                           f"tensor ({str(err).splitlines()[0]}): the checkpoint is inconsistent")

    def check_all_read(self) -> None:
        """Refuse tensors that no part of the model took: they would be dropped silently. An empty one drops nothing:
        transformers' DeepSeek-V2/V3 save zero-width shared experts where `n_shared_experts` is 0."""
        left = sorted(n for n in self.tensors if n not in self.read and not n.endswith("rotary_emb.inv_freq")
                      and self.tensors[n].numel() > 0)
        if left:
            raise ConfigError(f"tensor '{left[0]}'{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} of the "
                              "checkpoint has no place in the model its config.json describes (a bias, or a layer the "
                              "config does not declare?)")


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * its 128x128 block's scale; the last row/column blocks may be partial."""
    rows, cols = q.shape
    blocks = (-(-rows // TILE), -(-cols // TILE))
    if tuple(scale.shape) != blocks:
        raise ConfigError(f"'{name}_scale_inv' has shape {tuple(scale.shape)}, not the {blocks} blocks of 128x128 "
                          f"that a {rows} x {cols} weight has")
    return q.float() * scale.repeat_interleave(TILE, 0)[:rows].repeat_interleave(TILE, 1)[:, :cols]
