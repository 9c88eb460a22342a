"""The files a Hugging Face export writes and an import reads: one model.safetensors or shards with an index,
written so that a kill cannot leave an earlier export half-overwritten; and truncated, damaged or inconsistent files
(a short safetensors file or checkpoint shard, an index that disagrees with its shards) refused in one line. The
conversions themselves are in tests/test_convert.py."""
from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from megafp8.config import ConfigError

pytest.importorskip("safetensors")
from megafp8.checkpoint.hf import WEIGHTS_FILE, load_hf, save_hf  # noqa: E402
from tests.test_convert import CFG, llama_dir, tiny_model  # noqa: E402,F401  (llama_dir: a fixture)


def test_an_export_stopped_midway_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch):
    """`to-hf --overwrite` over an earlier export, stopped while it writes the weights (a job's time limit): the
    earlier model.safetensors and config.json are whole and still load; the next export replaces them and the
    leftover `.partial` file."""
    import safetensors.torch

    model = tiny_model()
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    before = {name: (tmp_path / "hf" / name).read_bytes() for name in (WEIGHTS_FILE, "config.json")}
    real_save = safetensors.torch.save_file

    def stopped(tensors, filename, metadata=None):
        with open(filename, "wb") as half:
            half.write(b"\x00" * 64)  # what a killed writer leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", stopped)
    with pytest.raises(KeyboardInterrupt):
        save_hf(tiny_model(seed=3).state_dict(), CFG, 128, tmp_path / "hf", fp8=True)
    assert {name: (tmp_path / "hf" / name).read_bytes() for name in before} == before
    assert load_hf(tmp_path / "hf").layout == "llama"
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    save_hf(tiny_model(seed=3).state_dict(), CFG, 128, tmp_path / "hf", fp8=True)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", WEIGHTS_FILE]
    assert (tmp_path / "hf" / WEIGHTS_FILE).read_bytes() != before[WEIGHTS_FILE]


def test_exported_files_get_the_mode_other_new_files_get(tmp_path):
    """safetensors wrote model.safetensors 0600 beside a 0644 config.json: others could not read a shared export."""
    import os

    mask = os.umask(0o022)
    try:
        save_hf(tiny_model().state_dict(), CFG, 64, tmp_path / "hf", fp8=False, shard_bytes=2**20)
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o644}, modes


def test_shards_hold_consecutive_tensors_of_at_most_the_size_and_a_larger_one_alone():
    from megafp8.checkpoint.hf import shard_files

    tensors = {name: torch.zeros(n, dtype=torch.bfloat16) for name, n in (("a", 100), ("b", 300), ("c", 700),
                                                                        ("d", 50), ("e", 60))}
    assert shard_files(tensors, 2420) == {WEIGHTS_FILE: ["a", "b", "c", "d", "e"]}  # 2,420 bytes in all
    assert shard_files(tensors, 10_000) == {WEIGHTS_FILE: ["a", "b", "c", "d", "e"]}
    assert shard_files(tensors, 1000) == {"model-00001-of-00003.safetensors": ["a", "b"],
                                          "model-00002-of-00003.safetensors": ["c"],  # 1,400 bytes: alone
                                          "model-00003-of-00003.safetensors": ["d", "e"]}


def test_an_export_in_shards_reads_back_and_replaces_an_earlier_single_file_export(tmp_path):
    """Shards with an index where the weights exceed shard_bytes; over an earlier export of the other form, the
    files that form used go (a model.safetensors beside an index is what transformers would read instead)."""
    model = tiny_model()
    out = tmp_path / "hf"
    save_hf(model.state_dict(), CFG, 64, out, fp8=False)
    (out / "tokenizer.json").write_text("{}")  # the user's own file: kept
    save_hf(model.state_dict(), CFG, 64, out, fp8=False, shard_bytes=2**20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", "tokenizer.json", *shards])
    from safetensors.torch import load_file
    saved = [t for shard in shards for t in load_file(str(out / shard)).values()]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved)
    state = load_hf(out).state
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t.float()), name
    save_hf(model.state_dict(), CFG, 64, out, fp8=False)  # and back to one file: the shards and index go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS_FILE, "tokenizer.json"]


def test_truncated_or_incomplete_files_give_clear_errors(tmp_path):
    model = tiny_model()
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    path = tmp_path / "hf" / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors file"):
        load_hf(tmp_path / "hf")
    from safetensors.torch import load_file, save_file
    path.write_bytes(data)
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ConfigError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf(tmp_path / "hf")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_hf(tmp_path)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight"])
def test_tensors_whose_shapes_disagree_among_themselves_are_refused_in_one_line(tmp_path, llama_dir, name):
    """A k_proj reading fewer inputs than q_proj and v_proj, a gate_proj than up_proj: no config.json describes that
    file. Before, torch.cat's RuntimeError came out of the tool as a traceback."""
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / WEIGHTS_FILE))
    tensors[name] = tensors[name][:, :128].contiguous()
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(ConfigError) as err:
        load_hf(tmp_path)
    assert f"{name} {tuple(tensors[name].shape)}" in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).endswith("the checkpoint is inconsistent")


def test_conversion_errors_name_the_short_shard_and_give_conversion_advice(tmp_path):
    from megafp8.checkpoint.convert import export_hf, import_hf, shard
    from megafp8.checkpoint.integrity import MANIFEST_FILE

    save_hf(tiny_model().state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    path, _, _ = import_hf(tmp_path / "hf", tmp_path / "ck")
    sharded = shard(path, tmp_path / "sharded")
    shard_file = sorted(sharded.glob("*.distcp"))[0]
    shard_file.write_bytes(shard_file.read_bytes()[: shard_file.stat().st_size // 2])
    with pytest.raises(ConfigError, match=rf"{shard_file.name} has \d+ bytes, \d+ were written: it is truncated or "
                                          r"damaged; convert an earlier checkpoint$"):
        export_hf(sharded, tmp_path / "out", fp8=False)
    (sharded / MANIFEST_FILE).unlink()  # an unverified read: the index shows which file is short
    with pytest.raises(ConfigError, match=rf"checkpoint file {re.escape(str(shard_file))} has \d+ bytes, its index "
                                          r"places \d+: it is truncated; convert an earlier checkpoint$"):
        export_hf(sharded, tmp_path / "out", fp8=False)
    with pytest.raises(ConfigError, match=r"not found; check the checkpoint path given to the tool$"):
        export_hf(tmp_path / "nowhere", tmp_path / "out", fp8=False)


def _sharded(source, target, shards: list[list[str]], index: dict | None = None):
    """`target`: `source`'s config.json and its tensors written as the shards named (a tensor may be in two), with
    `index` (by default the true one) as model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / WEIGHTS_FILE))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        chosen = [n for n in names if any(n.startswith(prefix) for prefix in part)]
        save_file({n: tensors[n] for n in chosen}, str(target / file))
        weight_map.update({n: file for n in chosen})
    index = {"metadata": {}, "weight_map": weight_map} if index is None else index
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def test_sharded_safetensors_that_disagree_with_their_index_are_refused(tmp_path, llama_dir):
    whole = ["lm_head", "model.embed_tokens", "model.norm"]
    layers = ["model.layers.0", "model.layers.1"]
    state = load_hf(_sharded(llama_dir, tmp_path / "good", [whole, layers])).state  # a true index: read
    assert torch.equal(state["embed.weight"], load_hf(llama_dir).state["embed.weight"])
    with pytest.raises(ConfigError, match=r"tensor 'model.norm.weight' is in two files, model-00001-of-00002."
                                          r"safetensors and model-00002-of-00002.safetensors: which one is meant is "
                                          r"unclear"):
        load_hf(_sharded(llama_dir, tmp_path / "twice", [whole, layers + ["model.norm"]]))
    lying = _sharded(llama_dir, tmp_path / "lying", [whole, layers])
    index = json.loads((lying / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (lying / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json places tensor 'model.norm.weight' in "
                                          r"model-00002-of-00002.safetensors, but model-00001-of-00002.safetensors "
                                          r"holds it"):
        load_hf(lying)
    both = _sharded(llama_dir, tmp_path / "both", [whole, layers])
    (both / WEIGHTS_FILE).symlink_to(llama_dir / WEIGHTS_FILE)
    with pytest.raises(ConfigError, match=r"holds both model.safetensors and model.safetensors.index.json"):
        load_hf(both)
    for name, text in (("model.safetensors.index.json", "{not json"), ("model.safetensors.index.json", "{}"),
                       ("config.json", "{")):
        broken = _sharded(llama_dir, tmp_path / f"broken-{len(list(tmp_path.iterdir()))}", [whole, layers])
        (broken / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{re.escape(str(broken / name))} is not a valid"):
            load_hf(broken)


def test_the_tool_answers_a_file_for_out_a_foreign_file_and_a_file_system_error_in_one_line(tmp_path, capsys,
                                                                                           monkeypatch):
    import tools.convert_checkpoint as tool

    def one_line_error(argv: list[str]) -> str:
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err[len("error: "):-1]

    afile = tmp_path / "afile.txt"
    afile.write_text("hello\n")
    for command in ("consolidate", "shard", "to-hf", "from-hf"):  # with --overwrite: was FileExistsError
        assert one_line_error([command, str(tmp_path), "--out", str(afile), "--overwrite"]) == (
            f"--out {afile} is a file, not a directory: choose another --out")
    torch.save(torch.ones(3), tmp_path / "tensor.pt")  # was RuntimeError from `"model" in tensor`
    assert one_line_error(["inspect", str(tmp_path / "tensor.pt")]) == (
        f"checkpoint file {tmp_path / 'tensor.pt'} holds a Tensor, not a megafp8 training checkpoint (a dict of model, "
        "optimizer, step and loader)")
    assert one_line_error(["inspect", str(afile)]).startswith(  # names torch's error type (the text alone was "101")
        f"checkpoint file {afile} is corrupt or not a megafp8 checkpoint (torch.load: ")
    for name, extra in (("state.pt", None), ("meta.pt", ".metadata")):  # torch's weights-only refusal: a page that
        damaged = tmp_path / f"damaged_{name}"                           # advised weights_only=False
        damaged.mkdir()
        (damaged / name).write_bytes(b"garbage\n")
        if extra:  # an intact index of no tensors: the index is read first (it names the shard files to check)
            (damaged / extra).write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
        assert one_line_error(["inspect", str(damaged)]) == (
            f"checkpoint file {damaged / name} is corrupt or not a megafp8 checkpoint (torch.load: WeightsUnpickler "
            "error: Unsupported operand 103)")

    hf = tmp_path / "hf"
    save_hf(tiny_model().state_dict(), CFG, 64, hf, fp8=False)
    for command in (["inspect", str(hf)], ["to-hf", str(hf), "--out", str(tmp_path / "x")]):  # was "incomplete (no
        assert one_line_error(command) == (                                                     # checksums.json ...)"
            f"{hf} is a Hugging Face model directory, not a megafp8 checkpoint: import it first "
            f"(tools/convert_checkpoint.py from-hf {hf} --out DIR)")
    (tmp_path / "latest").write_text("step_00000008\n")  # was "corrupt ... IndexError: pop from empty list"
    assert one_line_error(["inspect", str(tmp_path / "latest")]) == (
        f"{tmp_path / 'latest'} is the pointer to the newest checkpoint (it names 'step_00000008'): give that "
        f"checkpoint, {tmp_path / 'step_00000008'}")

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "ro" / "step_00000000"))

    monkeypatch.setattr(tool, "consolidate", read_only)  # was OSError's traceback
    assert one_line_error(["consolidate", str(tmp_path), "--out", str(tmp_path / "ro")]) == (
        f"{tmp_path / 'ro' / 'step_00000000'}: Read-only file system")


def test_inspect_tells_a_directory_that_is_no_checkpoint_from_one_cut_short(tmp_path, capsys):
    """A directory that is no checkpoint at all was 'incomplete (no checksums.json: its save did not finish)', as if
    a save had been cut off; checkpoints that are cut short keep that message."""
    import tools.convert_checkpoint as tool

    def error_of(directory) -> str:
        assert tool.main(["inspect", str(directory)]) == 2
        return capsys.readouterr().err

    plain = tmp_path / "notes"
    plain.mkdir()
    (plain / "notes.txt").write_text("hello\n")
    assert error_of(plain) == (
        f"error: {plain} is not a checkpoint of any format megafp8 knows: it holds no checksums.json or state.pt (a "
        "full checkpoint), no .metadata, meta.pt or *.distcp (a sharded one), no step_NNNNNNNN directories (a run's "
        "checkpoints) and no config.json with *.safetensors (a Hugging Face model): give a checkpoint's directory, "
        "step_NNNNNNNN\n")
    shards_only = tmp_path / "copied"  # a sharded save stopped after its ranks' files, before its index
    shards_only.mkdir()
    (shards_only / "__0_0.distcp").write_bytes(b"\0" * 64)
    stray = tmp_path / "step_00000004"  # a checkpoint by its name, whatever is left in it
    stray.mkdir()
    (stray / "notes.txt").write_text("hello\n")
    for cut in (shards_only, stray):
        assert error_of(cut) == (f"error: checkpoint {cut} is incomplete (no checksums.json: its save did not "
                                 "finish); convert an earlier checkpoint\n")
