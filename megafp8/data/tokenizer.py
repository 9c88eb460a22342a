"""Tokenizers: a byte-level one that needs no files, and Hugging Face `tokenizers` JSON files.

A tokenizer is named by a spec string stored with the tokenized data: `byte`, or the path of
a `tokenizer.json`. Every document ends with the end-of-document token; with a beginning-of-document token
(`bos_id`, a tokenizer.json's only, chosen at preprocessing) it also begins with that one, as Llama's and
DeepSeek's models were trained.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from megafp8.config import ConfigError

# End-of-document tokens tried, in order, when a tokenizer.json does not say which to use.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer(Protocol):
    spec: str
    vocab_size: int
    eos_id: int
    bos_id: int | None  # the token each document begins with, if any

    def document(self, text: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then end-of-document (256) and padding (257)."""

    spec = "byte"
    vocab_size = 258
    eos_id = 256
    pad_id = 257
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def document(self, text: str) -> list[int]:
        """A text's ids as a document of the training data begins (the byte tokenizer has no beginning token)."""
        return self.encode(text)

    def encode_bytes(self, text: str) -> bytes:
        """The token ids as raw bytes (each id < 256); the fast path of preprocessing."""
        return text.encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local `tokenizer.json` (no network)."""

    def __init__(self, path: str, eos_token: str | None = None, eos_id: int | None = None,
                 bos_token: str | None = None, bos_id: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise ConfigError(
                "a tokenizer.json needs the `tokenizers` package: pip install 'megafp8[hf]' (or pip install tokenizers)"
            ) from None
        if Path(path).is_dir():
            inside = " (it holds one: pass that file)" if (Path(path) / "tokenizer.json").is_file() else ""
            raise ConfigError(f"tokenizer '{path}' is a directory{inside}; pass its tokenizer.json path or 'byte'")
        if not Path(path).is_file():
            raise ConfigError(f"tokenizer file '{path}' does not exist; pass a tokenizer.json path or 'byte'")
        self.spec = str(Path(path).resolve())
        try:
            self._tok = _HFTokenizer.from_file(self.spec)
        except Exception as err:  # the Rust library raises a bare Exception (e.g. "expected value at line 1 ...")
            raise ConfigError(f"tokenizer file '{path}' is not a Hugging Face tokenizer.json ({err}); pass one "
                              "(tools/train_tokenizer.py makes one) or 'byte'") from None
        # Ids need not be 0..n-1 (a tokenizer.json may leave gaps, e.g. special tokens placed high): the vocabulary
        # must hold the largest id, or its tokens would be stored in too narrow a dtype.
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eos_token, self.eos_id = self._find_eos(eos_token, eos_id)
        self.bos_token, self.bos_id = self._find_bos(bos_token, bos_id)

    def _find_eos(self, eos_token: str | None, eos_id: int | None) -> tuple[str, int]:
        """The end-of-document token and its id: `eos_token`, else the token of `eos_id` (the id a corpus was made
        with), else the first of the usual ones the tokenizer has; where both are given, they must agree."""
        if eos_token is None and eos_id is not None:
            token = self._tok.id_to_token(eos_id)
            if token is None:
                raise ConfigError(f"the data was made with end-of-document id {eos_id}, which tokenizer {self.spec} "
                                  "has no token for: give the tokenizer.json it was preprocessed with")
            return token, eos_id
        for token in ([eos_token] if eos_token else list(_EOS_CANDIDATES)):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                if eos_id not in (None, token_id):
                    raise ConfigError(f"the data was made with end-of-document id {eos_id}, but {token!r} is id "
                                      f"{token_id} in {self.spec}: give the --eos-token it was preprocessed with")
                return token, token_id
        wanted = f"'{eos_token}'" if eos_token else f"any of {', '.join(_EOS_CANDIDATES)}"
        raise ConfigError(f"tokenizer {self.spec} has no end-of-document token ({wanted}); pass --eos-token")

    def _find_bos(self, bos_token: str | None, bos_id: int | None) -> tuple[str | None, int | None]:
        """The beginning-of-document token and its id: `bos_token`, else the token of `bos_id` (the id a corpus was
        made with), else none; never the end-of-document token (a document already follows one)."""
        if bos_token is None and bos_id is None:
            return None, None
        if bos_token is None:
            token = self._tok.id_to_token(bos_id)
            if token is None:
                raise ConfigError(f"the data was made with beginning-of-document id {bos_id}, which tokenizer "
                                  f"{self.spec} has no token for: give the tokenizer.json it was preprocessed with")
            return token, bos_id
        token_id = self._tok.token_to_id(bos_token)
        if token_id is None:
            known = ", ".join(repr(t) for t in self.template_prefix()) or "none"
            raise ConfigError(f"tokenizer {self.spec} has no token {bos_token!r} (--bos-token): give one of its "
                              f"tokens (the one its template begins a text with: {known})")
        if token_id == self.eos_id:
            raise ConfigError(f"--bos-token {bos_token!r} is the end-of-document token, which every document "
                              "already follows: drop --bos-token")
        if bos_id not in (None, token_id):
            raise ConfigError(f"the data was made with beginning-of-document id {bos_id}, but {bos_token!r} is id "
                              f"{token_id} in {self.spec}: give the --bos-token it was preprocessed with")
        return bos_token, token_id

    def template_prefix(self) -> list[str]:
        """The tokens this tokenizer.json's template (its post-processor) puts before a text, e.g.
        ['<|begin_of_text|>'] for Llama 3's, ['<s>'] for Llama 2's: what its models saw at each document's start."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        framed = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(framed) - len(bare) + 1):
            if framed[start:start + len(bare)] == bare:
                return [self._tok.id_to_token(i) for i in framed[:start]]
        return []

    def template_bos(self) -> str | None:
        """The token this tokenizer.json's template begins a text with, where that is a beginning-of-document token
        (not its end-of-document one): the token `--bos-token` should name for data a model of it continues on."""
        prefix = self.template_prefix()
        return prefix[0] if prefix and prefix[0] != self.eos_token else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def document(self, text: str) -> list[int]:
        """A text's ids as a document of the training data begins: the beginning-of-document token, where the data
        has one, then the text's ids."""
        return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)



def tokenizer_of_data(spec: str, eos_token: str | None, eos_id: int | None, bos_id: int | None = None) -> Tokenizer:
    """The tokenizer `spec` with the end-of-document token a corpus was made with, whose id `eos_id` the data's
    fingerprint records (None: written before it did): `eos_token` where given (refused where it is another id),
    else the token of that id, else the tokenizer's default. Without it, data made with `--eos-token` would be read
    back with the default, a token that ends no document of it (generation not stopping, an export's
    eos_token_id wrong). `bos_id`: the beginning-of-document id the data's documents begin with (None: none)."""
    if spec != "byte":
        return HFTokenizer(spec, eos_token, eos_id, bos_id=bos_id)
    if bos_id is not None:
        raise ConfigError(f"the data was made with beginning-of-document id {bos_id}, which the byte tokenizer has "
                          "not: give the tokenizer.json it was preprocessed with")
    tok = load_tokenizer(spec, eos_token)
    if eos_id not in (None, tok.eos_id):
        raise ConfigError(f"the data was made with end-of-document id {eos_id}, not the byte tokenizer's "
                          f"{tok.eos_id}: give the tokenizer.json it was preprocessed with")
    return tok


def load_tokenizer(spec: str, eos_token: str | None = None, bos_token: str | None = None) -> Tokenizer:
    """`byte` or a path to a tokenizer.json."""
    if spec == "byte":
        if eos_token is not None:
            raise ConfigError(f"--eos-token {eos_token!r} belongs to a tokenizer.json: the byte tokenizer's "
                              "end-of-document token is its own (id 256); drop it, or pass --tokenizer FILE.json")
        if bos_token is not None:
            raise ConfigError(f"--bos-token {bos_token!r} belongs to a tokenizer.json: the byte tokenizer has no "
                              "beginning-of-document token; drop it, or pass --tokenizer FILE.json")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token, bos_token=bos_token)
