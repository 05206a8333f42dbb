"""Token files and the batch loader (core/data/loader.py): atomic writes, dtype checks, validation, determinism.

    python -m pytest tests/test_data.py
"""
import json
import math
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from core.data.loader import TokenData, batch_generator, read_meta
from core.data.writer import ShardWriter, write_dataset, write_tokens
from core.errors import UserError
import core.fileio

ROOT = Path(__file__).resolve().parents[1]


def make_dataset(data_dir: Path, vocab_size: int = 1000, dtype=np.uint16, **splits) -> Path:
    """A prepared dataset: `{split}.bin` for each array in `splits`, and meta.json."""
    write_dataset(data_dir, {"tokenizer": "test", "vocab_size": vocab_size}, splits, dtype)
    return data_dir


def make_sharded(data_dir: Path, split: str, shards: list[np.ndarray], vocab_size: int = 10_000) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(shards):
        write_tokens(data_dir / f"{split}_{i:06d}.bin", shard)
    meta = {"tokenizer": "test", "vocab_size": vocab_size, "dtype": "uint16", f"{split}_tokens": sum(map(len, shards))}
    (data_dir / "meta.json").write_text(json.dumps(meta))
    return data_dir


# --- writing ---------------------------------------------------------------------------------


def test_write_tokens_round_trips(tmp_path):
    ids = [0, 1, 65535, 42]
    assert write_tokens(tmp_path / "a.bin", ids) == 4
    assert np.fromfile(tmp_path / "a.bin", dtype=np.uint16).tolist() == ids
    assert write_tokens(tmp_path / "b.bin", np.array([70000]), dtype=np.uint32) == 1
    assert np.fromfile(tmp_path / "b.bin", dtype=np.uint32).tolist() == [70000]


@pytest.mark.parametrize("ids, needle", [([1, 65536], "65536"), ([-1, 3], "-1"), ([1.5], "integers")])
def test_ids_that_do_not_fit_are_an_error_not_a_wrap(tmp_path, ids, needle):
    with pytest.raises(UserError, match=needle):
        write_tokens(tmp_path / "a.bin", ids)
    assert not (tmp_path / "a.bin").exists()
    with pytest.raises(UserError, match=needle), ShardWriter(tmp_path, "train", 10) as w:
        w.write(ids)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_write_leaves_no_final_file(tmp_path, monkeypatch):
    def crash(fd):
        raise OSError("disk vanished")  # after the data is written, before the rename

    (tmp_path / "old.bin").write_bytes(b"\x01\x00")
    monkeypatch.setattr(core.fileio.os, "fsync", crash)
    with pytest.raises(OSError, match="disk vanished"):
        write_tokens(tmp_path / "new.bin", np.arange(1000))
    with pytest.raises(OSError, match="disk vanished"):
        write_tokens(tmp_path / "old.bin", np.arange(1000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.bin"]  # no temporary left either
    assert (tmp_path / "old.bin").read_bytes() == b"\x01\x00"


def test_shard_writer_splits_and_replaces_stale_files(tmp_path):
    write_tokens(tmp_path / "train.bin", [9, 9])
    for i in range(5):
        write_tokens(tmp_path / f"train_{i:06d}.bin", [7])
    write_tokens(tmp_path / "train_notes.bin", [1])  # not a shard name: left alone
    ids = np.arange(25)
    with ShardWriter(tmp_path, "train", shard_tokens=10) as w:
        w.write(ids[:3])
        w.write(ids[3:])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["train_000000.bin", "train_000001.bin", "train_000002.bin", "train_notes.bin"]
    sizes = [len(np.fromfile(tmp_path / n, dtype=np.uint16)) for n in names[:3]]
    assert sizes == [10, 10, 5] and w.num_tokens == 25
    joined = np.concatenate([np.fromfile(tmp_path / n, dtype=np.uint16) for n in names[:3]])
    assert joined.tolist() == ids.tolist()


def test_interrupted_shard_writer_leaves_old_files(tmp_path):
    write_tokens(tmp_path / "train_000000.bin", [1, 2, 3])
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, "train", shard_tokens=4) as w:
        w.write(np.arange(10))
        raise RuntimeError("killed mid-way")
    assert [p.name for p in tmp_path.iterdir()] == ["train_000000.bin"]  # staging folder gone too
    assert np.fromfile(tmp_path / "train_000000.bin", dtype=np.uint16).tolist() == [1, 2, 3]


def test_sigkill_mid_write_leaves_no_final_shard(tmp_path):
    write_tokens(tmp_path / "train.bin", [1, 2, 3])
    child = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        sys.path.insert(0, {str(ROOT)!r})
        from core.data.writer import ShardWriter
        with ShardWriter({str(tmp_path)!r}, "train", shard_tokens=1000) as w:
            w.write(np.arange(5500) % 100)  # five complete shards and part of a sixth
            print("written", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["train.bin"]
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [1, 2, 3]


# --- metadata --------------------------------------------------------------------------------


def test_read_meta_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match=r"meta\.json not found; run the dataset's prepare\.py"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match=r"meta\.json is not valid JSON"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text('{"vocab_size": 5}')
    assert read_meta(tmp_path) == {"vocab_size": 5}


# --- batches ---------------------------------------------------------------------------------


def test_batch_generator_is_a_stable_function_of_its_keys():
    draw = lambda *keys: torch.randint(1 << 30, (8,), generator=batch_generator(*keys)).tolist()
    assert draw(1337, "train", 5, 0) == draw(1337, "train", 5, 0)
    assert draw(1337, "train", 5, 0) != draw(1337, "train", 5, 1)
    assert draw(1337, "train", 5, 0) != draw(1338, "train", 5, 0)
    assert draw(1337, "eval", "val", 5, 0) != draw(1337, "eval", "train", 5, 0)
    assert draw(1337, "train", 1) != draw(1337, "train", "1")
    # SHA-256 of the keys, not Python's salted hash(): this number is the same on every machine.
    assert batch_generator(1337, "train", 0, 0).initial_seed() == 6774092348769079979
    with pytest.raises(TypeError):
        batch_generator(1337, "train", 0.5)


def test_get_batch_gives_shifted_windows(tmp_path):
    data = make_dataset(tmp_path, train=np.arange(1000))
    x, y = TokenData(data, "train", block_size=16).get_batch(32, batch_generator(0, "train", 0))
    assert x.shape == y.shape == (32, 16) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # consecutive ids, so the next token is always id + 1
    assert int(x[:, 0].min()) >= 0 and int(y[:, -1].max()) <= 999


def test_a_shorter_window_is_the_first_tokens_of_the_full_one(tmp_path):
    """seq_len (the sequence-length warm-up) crops the windows block_size draws, from the same draws:
    a warm-up changes how much of each window is read, never which windows."""
    data = TokenData(make_dataset(tmp_path, train=np.random.default_rng(0).integers(0, 1000, 5000)), "train", 16)
    x, y = data.get_batch(4, batch_generator(7, "train", 3, 0))
    xs, ys = data.get_batch(4, batch_generator(7, "train", 3, 0), seq_len=5)
    assert xs.shape == ys.shape == (4, 5) and xs.is_contiguous()
    assert torch.equal(xs, x[:, :5]) and torch.equal(ys, y[:, :5])
    for bad in (0, 17):
        with pytest.raises(ValueError, match="seq_len must be in"):
            data.get_batch(4, batch_generator(7, "train", 3, 0), seq_len=bad)


def test_get_batch_is_deterministic_and_leaves_global_rngs_alone(tmp_path):
    data = TokenData(make_dataset(tmp_path, train=np.random.default_rng(0).integers(0, 1000, 5000)), "train", 8)
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    a = data.get_batch(4, batch_generator(7, "train", 3, 0))
    data.get_batch(4, batch_generator(7, "eval", "val", 3, 0))  # an eval draw in between changes nothing
    b = data.get_batch(4, batch_generator(7, "train", 3, 0))
    c = data.get_batch(4, batch_generator(7, "train", 3, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert all(np.array_equal(u, v) for u, v in zip(np.random.get_state(), np_state))
    assert random.getstate() == py_state


def test_windows_are_uniform_over_shards_and_never_cross_them(tmp_path):
    shards = [np.arange(0, 100), np.arange(1000, 1300), np.arange(5000, 5005)]  # the last one is too short
    data = TokenData(make_sharded(tmp_path, "train", shards), "train", block_size=10)
    x, y = data.get_batch(20_000, batch_generator(0, "train"))
    assert torch.equal(y, x + 1)  # a window that crossed a shard boundary would break the +1 run
    starts = set(x[:, 0].tolist())
    assert starts == set(range(0, 90)) | set(range(1000, 1290))  # every valid start, nothing else
    share = (x[:, 0] < 1000).float().mean().item()
    assert abs(share - 90 / 380) < 0.02  # proportional to each shard's windows


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (z = 3.09) at df degrees of freedom
    (Wilson-Hilferty: (X/df)^(1/3) is nearly normal)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_window_starts_are_uniform_within_each_shard(tmp_path):
    """Pearson's chi-square of 40,000 seeded draws against a uniform distribution over each shard's
    window starts, and the shards' shares against their window counts: under p = 0.001 with a fixed
    seed. A start drawn as, e.g., the sum of two uniform halves (triangular), or one that favours the
    first windows, is thousands over."""
    shards = [np.arange(0, 100), np.arange(1000, 1300)]  # 90 and 290 windows of 10 + 1 tokens
    data = TokenData(make_sharded(tmp_path, "train", shards), "train", block_size=10)
    n = 40_000
    starts = data.get_batch(n, batch_generator(0, "train"))[0][:, 0].numpy()
    for first, count in ((0, 90), (1000, 290)):
        inside = starts[(starts >= first) & (starts < first + count)] - first
        observed = np.bincount(inside, minlength=count)
        expected = len(inside) / count
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < chi_square_critical(count - 1), (first, chi2, chi_square_critical(count - 1))
    in_first = float((starts < 1000).sum())
    expected = np.array([n * 90 / 380, n * 290 / 380])
    chi2 = float((((np.array([in_first, n - in_first]) - expected) ** 2) / expected).sum())
    assert chi2 < 10.83, chi2  # df = 1, p = 0.001


def test_token_data_reads_what_write_dataset_wrote(tmp_path):
    write_tokens(tmp_path / "val_000000.bin", np.arange(7))  # a stale shard from an earlier prepare
    make_dataset(tmp_path, train=np.arange(100), val=np.arange(50), vocab_size=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert TokenData(tmp_path, "val", block_size=4, vocab_size=100).num_tokens == 50


def _message(tmp_path, split="train", block_size=8, vocab_size=None) -> str:
    with pytest.raises(UserError) as e:
        TokenData(tmp_path, split, block_size, vocab_size)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_split_file(tmp_path):
    make_dataset(tmp_path, train=np.arange(100))
    message = _message(tmp_path, split="val")
    assert f"{tmp_path / 'val.bin'} not found" in message and "prepare.py" in message


def test_missing_meta(tmp_path):
    write_tokens(tmp_path / "train.bin", np.arange(100))
    assert f"{tmp_path / 'meta.json'} not found" in _message(tmp_path)


def test_empty_file(tmp_path):
    make_dataset(tmp_path, train=np.arange(100))
    (tmp_path / "train.bin").write_bytes(b"")
    assert f"{tmp_path / 'train.bin'} is empty" in _message(tmp_path)


def test_byte_length_not_whole_tokens(tmp_path):
    make_dataset(tmp_path, train=np.arange(100))
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\x00")
    message = _message(tmp_path)
    assert f"{tmp_path / 'train.bin'} has 201 bytes, not a whole number of 2-byte uint16 tokens" in message


def test_fewer_tokens_than_block_size_plus_one(tmp_path):
    make_dataset(tmp_path, train=np.arange(8))
    message = _message(tmp_path, block_size=8)
    assert f"{tmp_path / 'train.bin'} has 8 tokens, fewer than block_size + 1 = 9" in message


def test_dataset_vocab_larger_than_model(tmp_path):
    make_dataset(tmp_path, train=np.arange(100), vocab_size=50257)
    message = _message(tmp_path, vocab_size=65)
    assert f"{tmp_path / 'meta.json'} has vocab_size 50257, larger than the model's vocab_size 65" in message


def test_token_count_disagrees_with_meta(tmp_path):
    make_dataset(tmp_path, train=np.arange(100))
    write_tokens(tmp_path / "train.bin", np.arange(60))  # e.g. files from another prepare run
    assert f"{tmp_path / 'train.bin'} holds 60 tokens but {tmp_path / 'meta.json'} says 100" in _message(tmp_path)


def test_single_file_and_shards_together_are_ambiguous(tmp_path):
    make_sharded(tmp_path, "train", [np.arange(100)])
    write_tokens(tmp_path / "train.bin", np.arange(100))
    assert "holds both train.bin and 1 train_*.bin shards" in _message(tmp_path)


def test_unknown_dtype_in_meta(tmp_path):
    make_dataset(tmp_path, train=np.arange(100))
    meta = read_meta(tmp_path) | {"dtype": "float32"}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert "has dtype 'float32', expected one of ['uint16', 'uint32']" in _message(tmp_path)


@pytest.mark.gpu
def test_cuda_batches_match_cpu_batches(tmp_path):
    data = TokenData(make_dataset(tmp_path, train=np.arange(1000)), "train", block_size=16)
    x, y = data.get_batch(8, batch_generator(0, "train", 0), "cuda")
    x_cpu, y_cpu = data.get_batch(8, batch_generator(0, "train", 0), "cpu")
    assert x.device.type == "cuda" and torch.equal(x.cpu(), x_cpu) and torch.equal(y.cpu(), y_cpu)
