"""The checkpoint directory format: crash safety, the tensor index, refusing bad files."""

import hashlib
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as WordLevelTokenizer
from tokenizers import models

from meshtron.checkpoint.boxes import flat_range_boxes, local_to_global, volume
from meshtron.checkpoint.hf_convert import convert
from meshtron.checkpoint.model_io import write_model_checkpoint
from meshtron.checkpoint.shards import Piece, current_umask, write_shard
from meshtron.checkpoint.store import (
    finalize_checkpoint,
    find_latest,
    open_checkpoint,
    read_manifest,
    save_tensors,
    temp_dir,
    verify_checkpoint,
)
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh.params import SliceSpec


def save(root, step, value=1.0, keep_last=0):
    tensors = {"model/w": torch.full((3, 2), value), "model/b": torch.arange(4.0)}
    return save_tensors(root, step, tensors, meta={"note": "x"}, keep_last=keep_last)


def test_save_then_load(tmp_path):
    path = save(tmp_path, 10, value=4.0)
    assert path.name == "step_00000010"
    assert (tmp_path / "latest").read_text().strip() == "step_00000010"
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 10 and manifest["note"] == "x"
    _, reader = open_checkpoint(path)
    assert torch.equal(reader.read("model/w"), torch.full((3, 2), 4.0))
    part = torch.empty(2)
    reader.read_into("model/b", ((1,), (2,)), part)
    assert part.tolist() == [1.0, 2.0]
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_format_2_checkpoint_with_sha256_checksums_still_loads(tmp_path):
    """Checkpoints written before XXH3-128 recorded sha256 digests under format 2."""
    path = save(tmp_path, 4, value=3.0)
    manifest = json.loads((path / "meta.json").read_text())
    assert manifest["format"] == 3 and all(d.startswith("xxh3-128:")
                                           for d in manifest["files"].values())
    manifest["format"] = 2
    manifest["files"] = {name: hashlib.sha256((path / name).read_bytes()).hexdigest()
                         for name in manifest["files"]}
    (path / "meta.json").write_text(json.dumps(manifest))
    verify_checkpoint(path)
    assert torch.equal(open_checkpoint(path)[1].read("model/w"), torch.full((3, 2), 3.0))
    manifest["files"]["shard-00000.safetensors"] = hashlib.sha256(b"else").hexdigest()
    (path / "meta.json").write_text(json.dumps(manifest))
    with pytest.raises(MeshtronError, match="checksum mismatch"):
        open_checkpoint(path)[1].read("model/w")


def test_pieces_from_several_ranks_assemble_into_global_tensors(tmp_path):
    """Two ranks each write half of a tensor; the index stitches them; a box across the
    seam reads from both files."""
    full = torch.arange(24.0).view(4, 6)
    tmp = temp_dir(tmp_path, 3, "tok")
    tmp.mkdir(parents=True)
    for rank in (0, 1):
        box = ((2 * rank, 0), (2, 6))
        write_shard(tmp, rank, [Piece("model/x", (4, 6), box, full[2 * rank : 2 * rank + 2])],
                    torch.get_rng_state())
    path = finalize_checkpoint(tmp, tmp_path, 3, 2, meta={})
    _, reader = open_checkpoint(path)
    out = torch.empty(2, 3)
    reader.read_into("model/x", ((1, 2), (2, 3)), out)
    assert torch.equal(out, full[1:3, 2:5])
    assert torch.equal(reader.read("model/x"), full)


def test_flat_ranges_and_tp_slices_map_to_global_boxes():
    shape = (3, 4, 5)
    for start, end in ((0, 60), (7, 8), (3, 47), (20, 40), (19, 41)):
        boxes = flat_range_boxes(shape, start, end)
        assert sum(volume(b) for b in boxes) == end - start
        marked = torch.zeros(shape)
        for offset, size in boxes:
            marked[tuple(slice(o, o + s) for o, s in zip(offset, size))] += 1
        assert torch.equal(marked.view(-1), (torch.arange(60) >= start).float()
                           * (torch.arange(60) < end).float())
    # [gate | up] split over 2 ranks, rank 1: local rows 0-1 are global 2-3, local 2-3 global 6-7
    spec = SliceSpec(dim=0, index=1, count=2, parts=2)
    pairs = local_to_global(((0, 0), (4, 3)), spec, (8, 3))
    assert pairs == [(((0, 0), (2, 3)), ((2, 0), (2, 3))), (((2, 0), (2, 3)), ((6, 0), (2, 3)))]


def test_newest_complete_checkpoint_wins_and_half_written_ones_are_skipped(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    (tmp_path / ".tmp-step_00000030-999").mkdir()
    warnings = []
    assert find_latest(tmp_path, warn=warnings.append).name == "step_00000020"
    assert warnings == [f"ignoring {tmp_path / '.tmp-step_00000030-999'}: a save that did not "
                        "complete"]


def test_an_unusable_newest_checkpoint_stops_unless_falling_back_is_asked_for(tmp_path):
    """A step directory exists only complete: one without a usable manifest was damaged
    later, so it is named in an error (default) or skipped with a warning (``previous``)."""
    save(tmp_path, 10)
    (tmp_path / "step_00000040").mkdir()
    with pytest.raises(MeshtronError, match=r"newest checkpoint is unusable: checkpoint "
                       r".*step_00000040 is incomplete: meta.json is missing; move it away, or "
                       r"set checkpoint.on_corrupt=previous"):
        find_latest(tmp_path, warn=pytest.fail)
    warnings = []
    assert find_latest(tmp_path, warnings.append, on_corrupt="previous").name == "step_00000010"
    assert len(warnings) == 1 and "step_00000040 is incomplete" in warnings[0]
    shard = tmp_path / "step_00000010" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")  # caught by verifying every file
    with pytest.raises(MeshtronError, match="none of the 2 checkpoints under .* is usable"):
        find_latest(tmp_path, warnings.append, on_corrupt="previous")
    assert "step_00000010/shard-00000.safetensors is corrupt" in warnings[-1]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_is_named_when_read(tmp_path, damage):
    path = save(tmp_path, 10)
    shard = path / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    _, reader = open_checkpoint(path)
    with pytest.raises(MeshtronError, match=r"step_00000010/shard-00000.safetensors is corrupt"):
        reader.read("model/w")


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]


def _edit_manifest(path, edit):
    manifest = json.loads((path / "meta.json").read_text())
    edit(manifest)
    (path / "meta.json").write_text(json.dumps(manifest))


def test_manifest_cannot_point_outside_its_directory(tmp_path):
    path = save(tmp_path, 1)
    _edit_manifest(path, lambda m: m["files"].update({"../../etc/passwd": "0" * 64}))
    with pytest.raises(MeshtronError, match="names a file outside itself"):
        read_manifest(path)


def test_pickled_files_are_refused_unopened(tmp_path):
    """A checkpoint whose index lists a pickle (or whose shard is one) never unpickles it."""
    marker = tmp_path / "exploited"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = save(tmp_path / "a", 1)
    (path / "model.bin").write_bytes(pickle.dumps(Payload()))
    _edit_manifest(path, lambda m: m["files"].update({"model.bin": "0" * 64}))
    with pytest.raises(MeshtronError, match="never pickled"):
        read_manifest(path)
    path = save(tmp_path / "b", 1)
    shard = path / "shard-00000.safetensors"
    shard.write_bytes(pickle.dumps(Payload()))
    _edit_manifest(path, lambda m: m["files"].update(
        {"shard-00000.safetensors": hashlib.sha256(shard.read_bytes()).hexdigest()}))
    _, reader = open_checkpoint(path)
    with pytest.raises(MeshtronError, match="cannot be read"):
        reader.read("model/w")
    assert not marker.exists()


def test_index_shape_and_box_mismatches_are_refused_before_reading(tmp_path):
    path = save(tmp_path, 1)
    _edit_manifest(path, lambda m: m["tensors"]["model/w"]["pieces"][0].update(size=[9, 2]))
    with pytest.raises(MeshtronError, match="lies outside shape"):
        open_checkpoint(path)
    path = save(tmp_path / "b", 1)

    def grow(m):
        m["tensors"]["model/w"]["shape"] = [4, 2]
        m["tensors"]["model/w"]["pieces"][0]["size"] = [4, 2]

    _edit_manifest(path, grow)
    _, reader = open_checkpoint(path)
    with pytest.raises(MeshtronError, match=r"has shape \[3, 2\], the index says \[4, 2\]"):
        reader.read("model/w")
    path = save(tmp_path / "c", 1)
    _edit_manifest(path, lambda m: m["tensors"]["model/w"].update(dtype="object"))
    with pytest.raises(MeshtronError, match="no valid dtype"):
        open_checkpoint(path)


def test_a_foreign_safetensors_key_is_named(tmp_path):
    path = save(tmp_path, 1)
    save_file({"other": torch.zeros(1)}, str(path / "shard-00000.safetensors"))
    _edit_manifest(path, lambda m: m["files"].update(
        {"shard-00000.safetensors": hashlib.sha256(
            (path / "shard-00000.safetensors").read_bytes()).hexdigest()}))
    _, reader = open_checkpoint(path)
    with pytest.raises(MeshtronError, match="key 'p0' is missing"):
        reader.read("model/w")


def test_empty_or_missing_root_has_no_checkpoint(tmp_path):
    assert find_latest(tmp_path / "nothing") is None
    os.makedirs(tmp_path / "empty")
    assert find_latest(tmp_path / "empty") is None


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"),
                         [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)],
                         ids=["umask-022", "umask-077"])
def test_checkpoint_and_hf_export_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """safetensors writes 0o600 files by itself; ours get the mode the umask gives any file."""
    cfg = load_config(overrides=["--model.num_layers=1", "--model.hidden_size=32",
                                 "--model.num_heads=2", "--model.num_kv_heads=2",
                                 "--model.ffn_hidden_size=64",
                                 "--model.vocab_size=128", "--model.max_seq_len=16"])
    state = {k: torch.zeros_like(v) for k, v in Transformer(cfg.model).state_dict().items()}
    tokenizer = tmp_path / "tokenizer.json"
    WordLevelTokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tokenizer))
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        save(tmp_path / "store", 1)
        write_model_checkpoint(tmp_path / "model", cfg, state, tokenizer=tokenizer)
        convert(tmp_path / "model", tmp_path / "hf", "hf")
    finally:
        os.umask(old)
    written = [p for root in ("store", "model", "hf") for p in (tmp_path / root).rglob("*")]
    assert {p.name for p in written} >= {"shard-00000.safetensors", "model.safetensors"}
    for path in [tmp_path / "store", tmp_path / "model", tmp_path / "hf", *written]:
        expected = dir_mode if path.is_dir() else file_mode
        assert path.stat().st_mode & 0o777 == expected, f"{path}: {oct(path.stat().st_mode)}"


def test_the_finite_check_sees_nan_and_inf_but_not_an_overflowing_sum(tmp_path):
    from meshtron.checkpoint.shards import check_finite

    huge = torch.full((4,), 3e38)  # finite, but its sum overflows float32
    check_finite(tmp_path, "w", huge)
    check_finite(tmp_path, "w", huge.to(torch.float16).nan_to_num(posinf=60000.0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.zeros(5)
        values[3] = bad
        with pytest.raises(MeshtronError, match="NaN or infinite"):
            check_finite(tmp_path, "w", values)


def test_replicated_tensors_go_to_the_rank_that_has_written_least():
    """Round-robin gave one rank every large tensor (embeddings and their moments); by bytes
    the ranks' shares stay within one tensor of each other."""
    from meshtron.checkpoint.held import next_writer

    written = [0, 0]
    sizes = [10, 1, 1, 1, 10, 1]
    assert [next_writer(written, n) for n in sizes] == [0, 1, 1, 1, 1, 0]
    assert written == [11, 13]
