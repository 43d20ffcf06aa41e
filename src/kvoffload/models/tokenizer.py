"""Tokenizers: HF tokenizer.json directories, GGUF metadata (gpt2-style BPE), and a byte-level
tokenizer for tiny test models. One small interface: encode, decode, apply_chat_template."""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

from kvoffload.errors import KVOffloadError

CHAT_META = "tokenizer_meta.json"
# lone surrogates: what Python makes of bytes that are not UTF-8 in a command line (surrogateescape)
_SURROGATE = re.compile("[\ud800-\udfff]")


class TextInputError(KVOffloadError, ValueError):
    """Text to tokenize that is not a string or not valid Unicode."""


def check_text(text, what: str = "text") -> str:
    """text as it is, or one TextInputError: not a str, or holding bytes that were not UTF-8 (a command line's
    undecodable bytes arrive as lone surrogates, which no tokenizer can encode)."""
    if not isinstance(text, str):
        raise TextInputError(f"{what} must be a str, got {type(text).__name__}")
    bad = _SURROGATE.search(text)
    if bad:
        ch = ord(bad.group())
        byte = f"byte 0x{ch - 0xdc00:02x}" if 0xdc80 <= ch <= 0xdcff else f"code point U+{ch:04X}"
        raise TextInputError(f"{what} is not valid UTF-8 ({byte} at character {bad.start()}); pass UTF-8 text")
    return text


class Tokenizer:
    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.add_bos = add_bos  # prepend BOS ourselves (GGUF add_bos_token; HF post-processors add it themselves)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(check_text(text), add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        """Renders messages with the model's chat template, or returns None when it has none."""
        if not self.chat_template:
            return None
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    # --- persistence (beside an orbax checkpoint)
    def save(self, directory: str):
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        meta = dict(bos_token=self.bos_token, eos_token=self.eos_token, bos_token_id=self.bos_token_id,
                    eos_token_ids=list(self.eos_token_ids), add_bos=self.add_bos, chat_template=self.chat_template)
        with open(os.path.join(directory, CHAT_META), "w") as f:
            json.dump(meta, f, indent=1)

    @classmethod
    def load_saved(cls, directory: str) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        with open(os.path.join(directory, CHAT_META)) as f:
            meta = json.load(f)
        return cls(Backend.from_file(os.path.join(directory, "tokenizer.json")), **meta)


def _token_str(tok) -> str | None:
    if tok is None:
        return None
    return tok if isinstance(tok, str) else tok.get("content")


def load_hf_tokenizer(directory: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer | None:
    """tokenizer.json + tokenizer_config.json of an HF checkpoint directory; None when absent."""
    from tokenizers import Tokenizer as Backend

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        backend = Backend.from_file(path)
    except Exception as e:
        raise ValueError(f"{path}: corrupt tokenizer file ({e})") from e
    conf = {}
    conf_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(conf_path):
        with open(conf_path) as f:
            conf = json.load(f)
    template = conf.get("chat_template")
    tpl_file = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(tpl_file):
        with open(tpl_file) as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    bos, eos = _token_str(conf.get("bos_token")), _token_str(conf.get("eos_token"))
    eos_ids = list(eos_token_ids)
    if eos is not None and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in eos_ids:
        eos_ids.append(backend.token_to_id(eos))
    return Tokenizer(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                     bos_token_id=backend.token_to_id(bos) if bos else None, chat_template=template)


# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
SPACE = "\u2581"  # SentencePiece's space


def sentencepiece_merges(pieces, scores, types) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies: SentencePiece merges, among adjacent pieces, the
    pair whose joined piece scores highest. So every split of a normal piece into two pieces of the vocabulary
    is a merge, ranked by the joined piece's score (best first; ties by id)."""
    index = {p: i for i, p in enumerate(pieces)}
    ranked = []
    for i, (piece, ty) in enumerate(zip(pieces, types)):
        if ty != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-float(scores[i]), i, index[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(field, tokens):
    """A `tokenizers` BPE equal to a SentencePiece BPE model given as GGUF metadata (tokenizer.ggml.model ==
    'llama': pieces, scores, token types) without a dummy prefix (Gemma's): spaces normalized to U+2581, merges
    from the scores (`sentencepiece_merges`), byte fallback through the <0xNN> pieces, user-defined pieces
    matched whole in the normalized text (as SentencePiece does), control pieces special. Pieces made of spaces
    alone are written with spaces in such files; they are U+2581 runs here."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    if field("tokenizer.ggml.add_space_prefix", False):  # LLaMA 1/2's: not built (nor checked) yet
        raise ValueError("GGUF SentencePiece vocabularies with add_space_prefix (a dummy prefix: LLaMA 1/2) are not "
                         "supported yet; Gemma's (no prefix) are")

    pieces = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    types = field("tokenizer.ggml.token_type") or [NORMAL] * len(pieces)
    scores = field("tokenizer.ggml.scores") or [-float(i) for i in range(len(pieces))]
    unk_id = field("tokenizer.ggml.unknown_token_id")
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Backend(models.BPE(vocab=vocab, merges=sentencepiece_merges(pieces, scores, types), byte_fallback=True,
                                 fuse_unk=True, unk_token=pieces[unk_id] if unk_id is not None else None))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_tokens([AddedToken(p, special=False, normalized=True)
                        for p, ty in zip(pieces, types) if ty == USER_DEFINED])
    return backend, pieces, types


def gguf_tokenizer(reader, path: str) -> Tokenizer:
    """Builds the tokenizer GGUF metadata describes: byte-level BPE (tokenizer.ggml.model == 'gpt2') or a
    SentencePiece BPE vocabulary with scores ('llama', without a dummy prefix: Gemma's)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    def field(k, default=None):
        f = reader.fields.get(k)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (gpt2 byte-level BPE, llama "
                         "SentencePiece BPE)")
    tokens = field("tokenizer.ggml.tokens")
    if kind == "llama":
        backend, tokens, types = _sentencepiece_backend(field, tokens)
        return _gguf_finish(field, backend, tokens, types, add_bos_default=True)
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "qwen2", "llama3", "llama-bpe"):
        # these llama.cpp pre-tokenizers split every digit on its own before the gpt2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return _gguf_finish(field, backend, tokens, types, add_bos_default=False)


def _gguf_finish(field, backend, tokens, types, add_bos_default: bool) -> Tokenizer:
    """Control pieces special, BOS / EOS and the chat template's stops from GGUF metadata. add_bos_default: where
    the file has no add_bos_token flag (llama.cpp adds BOS to a SentencePiece vocabulary that does not say)."""
    from tokenizers import AddedToken

    # control tokens (type 3) are special and matched whole in text
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    backend.add_special_tokens(specials)
    vocab = {t: i for i, t in enumerate(tokens)}
    bos_id = field("tokenizer.ggml.bos_token_id")
    eos_id = field("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos_id)] if eos_id is not None else []
    template = field("tokenizer.chat_template")
    # chat models end a turn with <|im_end|> / <|eot_id|> / <end_of_turn>: stop there too
    for stop in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"):
        if stop in vocab and vocab[stop] not in eos_ids and template and stop in template:
            eos_ids.append(vocab[stop])
    return Tokenizer(
        backend, bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None, bos_token_id=bos_id,
        eos_token_ids=eos_ids, add_bos=bool(field("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=template,
    )


def byte_tokenizer() -> Tokenizer:
    """Bytes 0..255 plus <s>=256, </s>=257: a real tokenizer for tiny random test models."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    # ByteLevel maps byte b to a printable char; token id = byte value
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["<s>"], vocab["</s>"] = 256, 257
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", bos_token_id=256, eos_token_ids=(257,), add_bos=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
