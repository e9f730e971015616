"""Data: tokenizers, sources (the recipes' corpus, text, folders, .bin), held-out split, the sampler."""

from pathlib import Path

import numpy as np
import pytest
import torch
from data import ByteTokenizer, Sampler, TokenWindows, default_corpus, load_tokens, val_batches


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — ünïcode\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids + [tok.eos_id]) == text and tok.vocab_size == 258


def test_the_recipes_corpus_exists_with_license():
    path = default_corpus()
    assert path.is_file() and 0.5e6 < path.stat().st_size < 5e6
    assert path.parent == Path(__file__).resolve().parents[2] / "recipes" / "corpus"  # with the recipes
    license_text = (path.parent / "CORPUS_LICENSE.txt").read_text()
    assert license_text.startswith("recipes/corpus/corpus.txt: docstrings") and "Python Software Foundation" in license_text
    tokens = load_tokens("", ByteTokenizer())
    assert tokens.dtype == np.uint16 and len(tokens) > 0.5e6 and (tokens == ByteTokenizer.eos_id).sum() > 1000


def test_text_folder_glob_and_bin(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub" / "b.md").write_text("world")
    (tmp_path / "skip.py").write_text("ignored")
    folder = load_tokens(str(tmp_path), tok)
    assert folder.tolist() == tok.encode("hello") + [tok.eos_id] + tok.encode("world") + [tok.eos_id]
    assert load_tokens(str(tmp_path / "*.txt"), tok).tolist() == tok.encode("hello") + [tok.eos_id]
    for dtype in ("uint16", "uint32"):
        arr = np.arange(1000, dtype=dtype) * (70 if dtype == "uint32" else 1)
        arr.tofile(tmp_path / f"t_{dtype}.bin")
        got = load_tokens(str(tmp_path / f"t_{dtype}.bin"), tok, dtype)
        assert isinstance(got, np.memmap) and np.array_equal(got, arr)


def test_no_data_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data.path = .*no data found"):
        load_tokens(str(tmp_path / "missing"), ByteTokenizer())
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="hold no tokens"):
        load_tokens(str(tmp_path), ByteTokenizer())
    (tmp_path / "t.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="mixes .bin token files and text files"):
        load_tokens(str(tmp_path), ByteTokenizer())


def test_windows_and_val_split():
    w = TokenWindows(np.arange(1001, dtype=np.uint16), seq_len=10, val_fraction=0.1)
    assert (w.n_train, w.n_val) == (90, 10)
    x, y = w.batch([3])
    assert x[0].tolist() == list(range(30, 40)) and y[0].tolist() == list(range(31, 41))
    # held-out windows never appear in training batches
    s = Sampler(w, batch_size=4, rank=0, world_size=2, seed=0)
    seen = {int(s.next()[0][i, 0]) // 10 for _ in range(50) for i in range(4)}
    assert max(seen) < 90
    vx = [b[0] for b in val_batches(w, 2, 1, 2, n_batches=10)]
    assert len(vx) == 2 and all(int(b[0, 0]) // 10 >= 90 for b in vx)


def test_sampler_deterministic_disjoint_and_resumable():
    w = TokenWindows(np.arange(2001, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    ranks = [Sampler(w, 3, r, 2, seed=7) for r in range(2)]
    epoch = [[tuple(s.next()[0][:, 0].tolist()) for _ in range(ranks[0].per_epoch)] for s in ranks]
    starts = [v for r in epoch for b in r for v in b]
    assert len(starts) == len(set(starts))  # the two ranks never see the same window in an epoch
    a = Sampler(w, 3, 1, 2, seed=7)
    for _ in range(40):  # into the second epoch
        a.next()
    b = Sampler(w, 3, 1, 2, seed=7)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(a.next()[0], b.next()[0])
    assert a.state_dict()["epoch"] == 1


def test_world_size_the_data_cannot_feed():
    w = TokenWindows(np.arange(101, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    with pytest.raises(ValueError, match="cannot feed world size 4: 10 train windows"):
        Sampler(w, 4, 0, 4, seed=0)
    with pytest.raises(ValueError, match="shorter data.seq_len"):
        TokenWindows(np.arange(5, dtype=np.uint16), seq_len=10, val_fraction=0.0)


def test_local_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'fsdp_optim[hf]')")
    from data import build_tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "hello": 1, "world": 2, "</s>": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == 4 and tok.eos_id == 3
    (tmp_path / "d.txt").write_text("hello world\fworld zzz")
    assert load_tokens(str(tmp_path / "d.txt"), tok).tolist() == [1, 2, 3, 2, 0, 3]
    with pytest.raises(ValueError, match="is not a file"):
        build_tokenizer(str(tmp_path / "missing.json"))


def test_make_corpus_reproduces_the_committed_prefix(tmp_path):
    import platform
    import subprocess
    import sys
    from pathlib import Path

    committed = default_corpus()
    if f"Python {platform.python_version()} " not in (committed.parent / "CORPUS_LICENSE.txt").read_text():
        pytest.skip("the committed corpus was built on another Python version (its docstrings differ)")
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_corpus.py"
    subprocess.run([sys.executable, str(script), "--max-mb", "0.05", "--out", str(tmp_path / "c.txt")],
                   check=True, capture_output=True, timeout=120)
    small = (tmp_path / "c.txt").read_bytes()[:-1]  # the script ends the file with a newline
    assert len(small) == 50_000 and committed.read_bytes().startswith(small)


def _stream(samplers: list[Sampler], steps: int) -> list[int]:
    """The windows of ``steps`` global batches, rank by rank (the order an uninterrupted run takes them)."""
    return [i for _ in range(steps) for s in samplers for i in s.next_indices()]


def test_sampler_batches_are_the_epoch_permutation_in_order():
    # Global batch k of an epoch is perm[k*B*W : (k+1)*B*W], rank r's share the r-th B of it (what
    # every run so far has trained on: the main job's numbers depend on it).
    w = TokenWindows(np.arange(2001, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(7 * 1_000_003)).tolist()
    ranks = [Sampler(w, 3, r, 2, seed=7) for r in range(2)]
    for k in range(5):
        for r, s in enumerate(ranks):
            assert s.next_indices() == perm[(k * 2 + r) * 3 : (k * 2 + r + 1) * 3]


@pytest.mark.parametrize("world, batch", [(1, 3), (3, 3), (2, 5), (4, 1)])
def test_sampler_resumes_at_another_world_size_or_batch_size(world, batch):
    # A W=2, B=3 run stopped after 7 steps and resumed at another W / B sees exactly the windows the
    # uninterrupted run would have seen next (no window repeated, none skipped).
    w = TokenWindows(np.arange(4001, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    before = [Sampler(w, 3, r, 2, seed=5) for r in range(2)]
    seen = _stream(before, 7)
    state = before[0].state_dict()
    assert state == {"epoch": 0, "windows": 42, "seed": 5, "n_train": 400}
    uninterrupted = _stream(before, 20)  # its next 20 steps of 6 windows
    after = [Sampler(w, batch, r, world, seed=5) for r in range(world)]
    for s in after:
        s.load_state_dict(state)
    n = len(uninterrupted) // (batch * world)
    got = _stream(after, n)
    assert got == uninterrupted[: len(got)] and len(got) > 60
    assert not set(got) & set(seen)


def test_sampler_refuses_a_state_of_other_windows():
    w = TokenWindows(np.arange(4001, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    state = Sampler(w, 3, 0, 2, seed=5).state_dict()
    with pytest.raises(ValueError, match="saved for seed 5, but this run has 6.*start a new --out"):
        Sampler(w, 3, 0, 2, seed=6).load_state_dict(state)
    shorter = TokenWindows(np.arange(3001, dtype=np.uint16), seq_len=10, val_fraction=0.0)
    with pytest.raises(ValueError, match="saved for n_train 400, but this run has 300"):
        Sampler(shorter, 3, 0, 2, seed=5).load_state_dict(state)
    old = Sampler(w, 3, 1, 2, seed=5)  # a checkpoint from before (epoch, global batch index): same B x W
    old.load_state_dict({"epoch": 0, "index": 4})
    assert old.state_dict()["windows"] == 24


def test_bin_file_checks_name_the_file(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    with pytest.raises(ValueError, match=r"data file '.*odd.bin' has 3 bytes, not a multiple of data.token_dtype "
                                         r"uint16 \(2 bytes per token\)"):
        load_tokens(str(tmp_path / "odd.bin"), tok, "uint16")
    np.array([5, 300, 7], np.uint16).tofile(tmp_path / "ids.bin")
    with pytest.raises(ValueError, match=r"data file '.*ids.bin' holds token id 300, but the model's vocabulary has "
                                         r"258 ids \(model.vocab_size\)"):
        load_tokens(str(tmp_path / "ids.bin"), tok, "uint16", vocab_size=258)
    assert load_tokens(str(tmp_path / "ids.bin"), tok, "uint16", vocab_size=301).tolist() == [5, 300, 7]


def test_text_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("ok caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"data file '.*latin1.txt' is not UTF-8 text: byte 6 is b'\\xe9'"):
        load_tokens(str(tmp_path / "latin1.txt"), ByteTokenizer())


def test_invalid_tokenizer_json_is_named(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'fsdp_optim[hf]')")
    from data import build_tokenizer

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"data.tokenizer: '.*tokenizer.json' is not a valid tokenizer.json \("):
        build_tokenizer(str(tmp_path / "tokenizer.json"))
