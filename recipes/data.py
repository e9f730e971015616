"""Data for pretraining: tokenizers, a token stream with a held-out tail, a deterministic per-rank sampler.

Sources (``data.path``):
- "" : the corpus that comes with the recipes (recipes/corpus/corpus.txt), so the first run works offline;
- a text file, a folder of text files (.txt/.md/.rst, recursively) or a glob: UTF-8 text (anything
  else is refused, naming the file and the byte), tokenized at startup;
- a ``.bin`` file (or a folder/glob of them): pre-tokenized tokens, ``uint16``/``uint32``, memory-mapped.

The stream is cut into windows of ``seq_len + 1`` tokens (input and shifted target); the last
``val_fraction`` of windows is the held-out split. The sampler visits train windows in a
permutation fixed by (seed, epoch) and hands out the next ``batch_size x world size`` of them at
each step, so a batch depends only on the sampler's position in windows, which checkpoints save and
restore (at any batch size and world size).
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256 and EOS=257: no vocabulary file, nothing to download."""

    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class HFTokenizer:
    """A local ``tokenizer.json`` via the ``tokenizers`` package (optional dependency)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ValueError(
                f"data.tokenizer = {path!r} needs the tokenizers package: pip install tokenizers "
                "(or pip install 'fsdp_optim[hf]'), or use data.tokenizer = 'byte'"
            ) from e
        if not Path(path).is_file():
            raise ValueError(f"data.tokenizer: {path!r} is not a file; give a local tokenizer.json or 'byte'")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers package raises a bare Exception for a malformed file
            raise ValueError(
                f"data.tokenizer: {path!r} is not a valid tokenizer.json ({e}); give a tokenizer.json saved by "
                "the tokenizers package, or 'byte'"
            ) from None
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id = self._first_id("<s>", "<|begin_of_text|>", "<bos>")
        self.eos_id = self._first_id("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")

    def _first_id(self, *names: str) -> int | None:
        return next((self.tok.token_to_id(t) for t in names if self.tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)


def build_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


def default_corpus() -> Path:
    """The recipes' own corpus (``data.path = ""``): next to this file, not in the installed library."""
    return Path(__file__).resolve().parent / "corpus" / "corpus.txt"


def _files(path: str) -> list[Path]:
    if os.path.isdir(path):
        return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + (".bin",))
    if any(c in path for c in "*?["):
        return sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    return [Path(path)] if os.path.isfile(path) else []


def _read_utf8(f: Path) -> str:
    """The text of ``f``; a ``ValueError`` naming the file and the first byte that is not UTF-8."""
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        try:
            f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:  # the byte offset in the file (the text reader's is per chunk)
            raise ValueError(
                f"data file {str(f)!r} is not UTF-8 text: byte {e.start} is {e.object[e.start:e.start + 1]!r}; "
                "convert it (e.g. iconv -f latin1 -t utf-8) or pre-tokenize it into a .bin file"
            ) from None
        raise


def _max_token(arr: np.ndarray, chunk: int = 1 << 26) -> int:
    """The largest id of a (memory-mapped) token array, read in chunks."""
    return max(int(arr[i : i + chunk].max()) for i in range(0, len(arr), chunk))


def fingerprint(tokens: np.ndarray) -> str:
    """A hash of the token stream's content (blake2b, 128 bits, hex), read in 64 MiB pieces."""
    h = hashlib.blake2b(digest_size=16)
    flat = tokens.reshape(-1)
    step = max(1, (64 << 20) // flat.itemsize)
    for i in range(0, flat.size, step):
        h.update(np.ascontiguousarray(flat[i : i + step]).tobytes())
    return h.hexdigest()


def load_tokens(
    path: str, tokenizer, token_dtype: str = "uint16", vocab_size: int | None = None, vocab_key: str = "model.vocab_size"
) -> np.ndarray:
    """The whole token stream of ``path`` (see module docstring) as a 1-D numpy array (memmap for .bin).
    ``vocab_size`` (set by config key ``vocab_key``): the model's vocabulary; a ``.bin`` file with an id
    at or above it is refused (it would index past the embedding table on every rank)."""
    if not path:
        files, where = [default_corpus()], "the embedded corpus"
    else:
        files, where = _files(path), f"data.path = {path!r}"
    if not files:
        raise ValueError(
            f"{where}: no data found (expected a text file, a folder of {'/'.join(TEXT_SUFFIXES)} or .bin files, "
            "or a glob); fix data.path, or leave it empty for the embedded corpus"
        )
    bins = [f for f in files if f.suffix == ".bin"]
    if bins:
        if len(bins) != len(files):
            raise ValueError(f"{where}: mixes .bin token files and text files; point data.path at one kind")
        if token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"data.token_dtype must be 'uint16' or 'uint32', got {token_dtype!r}")
        arrays = []
        for f in bins:
            size, item = f.stat().st_size, np.dtype(token_dtype).itemsize
            if size % item:
                raise ValueError(
                    f"data file {str(f)!r} has {size} bytes, not a multiple of data.token_dtype {token_dtype} "
                    f"({item} bytes per token); fix data.token_dtype or the file"
                )
            if not size:
                continue
            arrays.append(np.memmap(f, dtype=token_dtype, mode="r"))
            if vocab_size is not None and (top := _max_token(arrays[-1])) >= vocab_size:
                raise ValueError(
                    f"data file {str(f)!r} holds token id {top}, but the model's vocabulary has {vocab_size} ids "
                    f"({vocab_key}); use the tokenizer the file was made with (data.tokenizer) or raise {vocab_key}"
                )
        tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays else np.zeros(0, np.uint16)
    else:
        # Documents: files, split further on the corpus's form-feed separators; EOS between documents.
        dtype = np.uint32 if tokenizer.vocab_size > 65535 else np.uint16
        eos = [] if getattr(tokenizer, "eos_id", None) is None else [tokenizer.eos_id]
        chunks = [
            piece
            for f in files
            for doc in _read_utf8(f).split("\f")
            if doc.strip()
            for piece in (tokenizer.encode_array(doc.strip()).astype(dtype), np.asarray(eos, dtype))
        ]
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    if tokens.size == 0:
        raise ValueError(f"{where}: the files hold no tokens; fix data.path")
    return tokens


class TokenWindows:
    """Windows ``[i*seq_len, i*seq_len + seq_len + 1)`` of a token stream, split into train and val."""

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, where: str = "data"):
        self.tokens, self.seq_len = tokens, seq_len
        n = (len(tokens) - 1) // seq_len
        n_val = int(round(n * val_fraction)) if val_fraction > 0 else 0
        if val_fraction > 0:
            n_val = max(n_val, 1)
        self.n_train, self.n_val = n - n_val, n_val
        if self.n_train < 1:
            raise ValueError(
                f"{where}: {len(tokens)} tokens make {n} windows of data.seq_len={seq_len} (+{n_val} held out); "
                "give more data or a shorter data.seq_len"
            )

    def window(self, i: int) -> torch.Tensor:
        s = i * self.seq_len
        return torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.stack([self.window(i) for i in indices])
        return w[:, :-1], w[:, 1:]


class Sampler:
    """Deterministic, resumable per-rank batches of train windows.

    An epoch visits the train windows in a permutation seeded by ``seed`` and the epoch. Each call
    takes the epoch's next ``B*W`` windows (a global batch); rank ``r`` gets its ``B`` consecutive
    ones. An epoch ends when the rest cannot fill a global batch (that remainder is skipped).
    ``state_dict`` is the position in windows, ``(epoch, windows consumed in it)``, plus what fixes
    the permutation (the seed and the number of train windows): not in batches, so a run resumed at
    another batch size or world size continues with exactly the windows it would have seen next.
    """

    def __init__(self, data: TokenWindows, batch_size: int, rank: int, world_size: int, seed: int):
        self.data, self.B, self.rank, self.W, self.seed = data, batch_size, rank, world_size, seed
        self.per_epoch = data.n_train // (batch_size * world_size)
        if self.per_epoch < 1:
            raise ValueError(
                f"the data cannot feed world size {world_size}: {data.n_train} train windows of "
                f"seq_len {data.seq_len} < batch_size {batch_size} x world size {world_size}; "
                "give more data, or lower train.batch_size or data.seq_len"
            )
        self.epoch, self.consumed = 0, 0
        self._perm_epoch, self._perm = -1, None

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.data.n_train, generator=g), self.epoch
        return self._perm

    def next_indices(self) -> list[int]:
        """This rank's window indices of the next global batch (advances the position)."""
        if self.consumed + self.B * self.W > self.data.n_train:
            self.epoch, self.consumed = self.epoch + 1, 0
        start = self.consumed + self.rank * self.B
        self.consumed += self.B * self.W
        return self._permutation()[start : start + self.B].tolist()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(self.next_indices())

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "windows": self.consumed, "seed": self.seed, "n_train": self.data.n_train}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s position; refuses a state of another permutation (seed or data)."""
        if "windows" not in state:  # saved before positions were in windows: (epoch, global batches of B x W)
            self.epoch, self.consumed = int(state["epoch"]), int(state["index"]) * self.B * self.W
            return
        for key, mine in (("seed", self.seed), ("n_train", self.data.n_train)):
            if int(state[key]) != mine:
                raise ValueError(
                    f"the sampler position was saved for {key} {state[key]}, but this run has {mine}: the data "
                    "windows differ (train.seed, data.path, data.seq_len or data.val_fraction changed); "
                    "start a new --out"
                )
        self.epoch, self.consumed = int(state["epoch"]), int(state["windows"])


def val_batches(data: TokenWindows, batch_size: int, rank: int, world_size: int, n_batches: int):
    """The first ``n_batches`` global batches of the held-out windows, this rank's share (same every eval)."""
    val = list(range(data.n_train, data.n_train + data.n_val))
    per = batch_size * world_size
    if len(val) < per:
        raise ValueError(
            f"the held-out split ({len(val)} windows) cannot feed world size {world_size} x batch_size "
            f"{batch_size}; raise data.val_fraction or lower train.batch_size"
        )
    for k in range(min(n_batches, len(val) // per)):
        yield data.batch(val[k * per + rank * batch_size : k * per + (rank + 1) * batch_size])
