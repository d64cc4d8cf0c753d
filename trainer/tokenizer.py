"""Tokenizers: byte-level (the default), Hugging Face ``tokenizer.json``, SentencePiece.

``data.tokenizer`` (and ``python -m trainer.generate --tokenizer``) names one:

  * ``''``: byte-level, each UTF-8 byte its own id (0..255), ``EOS_ID`` = 256;
  * a ``tokenizer.json`` file (any name ending in ``.json``): the Hugging Face
    ``tokenizers`` library;
  * a ``.model`` file: SentencePiece;
  * a directory holding ``tokenizer.json`` or ``tokenizer.model`` (in that order).

Files are only read, never downloaded: a name that is not a local file is an
error saying where it was looked for. ``encode_documents`` also returns, per
token, how many bytes of the original UTF-8 text it accounts for (from the
tokenizer's offsets: a token takes the bytes up to the end of its span, so a
document's counts sum to its byte length), which keeps bits per byte defined
for any tokenizer.
"""

from __future__ import annotations

import codecs
import json
import os

import numpy as np
import sentencepiece
import tokenizers

from trainer import files

BYTE_VOCAB = 256
EOS_ID = 256
BYTE_TOKENIZER_VOCAB = 257
FILES = ('tokenizer.json', 'tokenizer.model')  # what a directory may hold, in this order
# End-of-document tokens tried when tokenizer_config.json names none.
EOS_CANDIDATES = ('</s>', '<|endoftext|>', '<|end_of_text|>', '<eos>', '[EOS]')


class Tokenizer:
  """Text <-> ids. ``eos_id`` ends a document (None: the tokenizer has none)."""
  name: str
  vocab_size: int
  eos_id: int | None
  byte_level: bool = False  # ids below BYTE_VOCAB are bytes

  def encode(self, text: str) -> list[int]:
    return self.encode_documents([text])[0][0].tolist()

  def encode_documents(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per document: (token ids, UTF-8 bytes each token accounts for), both int32."""
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError


class ByteTokenizer(Tokenizer):
  """Each byte is its own id; ``EOS_ID`` after each document."""
  name, vocab_size, eos_id, byte_level = 'bytes', BYTE_TOKENIZER_VOCAB, EOS_ID, True

  def encode_documents(self, texts):
    """Also takes bytes, kept exactly as they are (files need not be UTF-8)."""
    out = []
    for text in texts:
      ids = np.frombuffer(_utf8(text), np.uint8).astype(np.int32)
      out.append((ids, np.ones_like(ids)))
    return out

  def decode(self, ids) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB)
    return data.decode('utf-8', errors='replace')


class HuggingFaceTokenizer(Tokenizer):
  """A ``tokenizer.json`` read with the ``tokenizers`` library (no special tokens added)."""

  def __init__(self, path: str):
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f'tokenizer {path} is not a Hugging Face tokenizer.json '
                       f'({str(e).splitlines()[0][:200]})') from None
    self.name = path
    # The largest id + 1, what a model's embedding needs: get_vocab_size counts the tokens,
    # fewer when the ids have gaps.
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    self.eos_id = self._find_eos(os.path.join(os.path.dirname(path), 'tokenizer_config.json'))

  def _find_eos(self, config_file: str) -> int | None:
    names = list(EOS_CANDIDATES)
    if os.path.isfile(config_file):
      with open(config_file, encoding='utf-8') as f:
        eos = json.load(f).get('eos_token')
      eos = eos.get('content') if isinstance(eos, dict) else eos
      names = [eos] if isinstance(eos, str) else names
    ids = [self._tok.token_to_id(n) for n in names]
    return next((i for i in ids if i is not None), None)

  def encode_documents(self, texts):
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [(np.array(e.ids, np.int32), _bytes_per_token(text, [o[1] for o in e.offsets]))
            for text, e in zip(texts, encodings)]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece ``.model`` (no BOS/EOS added inside a document)."""

  def __init__(self, path: str):
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f'tokenizer {path} is not a SentencePiece model '
                       f'({str(e).splitlines()[0][:200]})') from None
    self.name = path
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

  def encode_documents(self, texts):
    out = []
    for text, proto in zip(texts, self._sp.encode(list(texts), return_type='proto')):
      ids = np.array([p.id for p in proto.pieces], np.int32)
      ends = np.array([p.end for p in proto.pieces], np.int64)  # byte offsets
      out.append((ids, _counts_from_byte_ends(ends, len(_utf8(text)))))
    return out

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


UTF8_ERRORS = ('strict', 'replace')  # what prepare's --errors takes
_REPLACED = [0]  # what the 'ringtrain-count' handler replaced in this process


def _count_and_replace(e: UnicodeError) -> tuple[str, int]:
  """'replace', counting: U+FFFD per undecodable sequence, '?' per unencodable character."""
  if isinstance(e, UnicodeDecodeError):
    _REPLACED[0] += 1
    return '\ufffd', e.end
  _REPLACED[0] += e.end - e.start
  return '?' * (e.end - e.start), e.end


codecs.register_error('ringtrain-count', _count_and_replace)


def utf8_decoder(errors: str = 'strict'):
  """An incremental UTF-8 decoder for ``decode_utf8`` (a file read piece by piece)."""
  return codecs.getincrementaldecoder('utf-8')('strict' if errors == 'strict'
                                               else 'ringtrain-count')


def decode_utf8(raw: bytes, name: str, offset: int = 0, errors: str = 'strict',
                decoder=None, final: bool = True) -> tuple[str, int]:
  """(the text of UTF-8 ``raw``, how many undecodable sequences became U+FFFD).

  ``errors='strict'`` raises ValueError naming ``name`` and the byte offset
  (``offset``: where ``raw`` starts in it) of the first undecodable byte;
  ``'replace'`` replaces and counts. A ``decoder`` (``utf8_decoder``) reads a
  file piece by piece: a character cut at a piece's end waits for the next
  (``final=False``).
  """
  decoder = decoder or utf8_decoder(errors)
  held, before = len(decoder.getstate()[0]), _REPLACED[0]
  try:
    text = decoder.decode(raw, final)
  except UnicodeDecodeError as e:  # its offsets count the held bytes, then raw's
    raise ValueError(f'{name} at byte {offset - held + e.start}: not UTF-8 ({e.reason}); '
                     'python -m trainer.prepare --errors=replace replaces such bytes (U+FFFD) '
                     'and counts them') from None
  return text, _REPLACED[0] - before


def encode_utf8(text: str, name: str, errors: str = 'strict') -> tuple[bytes, int]:
  """(``text`` as UTF-8, how many characters UTF-8 cannot hold became '?').

  Such characters are halves of surrogate pairs (a JSON escape can hold one);
  ``errors='strict'`` raises ValueError naming ``name`` and the character.
  """
  before = _REPLACED[0]
  try:
    raw = text.encode('utf-8', 'strict' if errors == 'strict' else 'ringtrain-count')
  except UnicodeEncodeError as e:
    raise ValueError(f'{name}: character {e.start} of the text is {text[e.start]!r}, half a '
                     "surrogate pair, which UTF-8 cannot hold (prepare's --errors=replace "
                     'replaces and counts such characters)') from None
  return raw, _REPLACED[0] - before


def _utf8(text: str | bytes) -> bytes:
  return text if isinstance(text, bytes) else text.encode('utf-8', errors='replace')


def _bytes_per_token(text: str, char_ends: list[int]) -> np.ndarray:
  """Byte counts from character end offsets (the ``tokenizers`` library counts chars)."""
  codepoints = np.frombuffer(text.encode('utf-32-le', errors='replace'), np.uint32)
  width = 1 + (codepoints >= 0x80) + (codepoints >= 0x800) + (codepoints >= 0x10000)
  byte_at = np.concatenate([[0], np.cumsum(width)])  # byte offset of each char boundary
  ends = byte_at[np.asarray(char_ends, np.int64)] if char_ends else np.zeros(0, np.int64)
  return _counts_from_byte_ends(ends, int(byte_at[-1]))


def _counts_from_byte_ends(ends: np.ndarray, total: int) -> np.ndarray:
  """Each token accounts for the bytes after the previous token's end up to its own.

  Tokens whose span ends inside an earlier one (several byte-fallback tokens
  of one character) get 0; the last token also takes any trailing bytes, so
  the counts of a document sum to its byte length.
  """
  if not len(ends):
    return np.zeros(0, np.int32)
  reach = np.maximum.accumulate(ends)
  counts = np.diff(reach, prepend=0)
  counts[-1] += total - reach[-1]
  return counts.astype(np.int32)


def resolve(spec: str) -> str:
  """The tokenizer file ``spec`` names; raises ValueError saying where it looked."""
  if os.path.isdir(spec):
    for name in FILES:
      if os.path.isfile(os.path.join(spec, name)):
        return os.path.join(spec, name)
    raise ValueError(f'tokenizer: no {" or ".join(FILES)} in directory '
                     f'{os.path.abspath(spec)}')
  if os.path.exists(spec) and not os.path.isfile(spec):  # before open: a FIFO would block
    files.check_regular(spec, 'tokenizer ')
  if not os.path.isfile(spec):
    raise ValueError(f'tokenizer file not found: {os.path.abspath(spec)} (a local '
                     'tokenizer.json, SentencePiece .model or a directory holding one; '
                     'nothing is downloaded)')
  return spec


def load(spec: str) -> Tokenizer:
  """The tokenizer ``spec`` names (see the module docstring); ``''`` is byte-level."""
  if not spec:
    return ByteTokenizer()
  path = resolve(spec)
  if path.endswith('.json'):
    return HuggingFaceTokenizer(path)
  if path.endswith('.model'):
    return SentencePieceTokenizer(path)
  raise ValueError(f'tokenizer {path}: unknown format (expected a Hugging Face .json '
                   'or a SentencePiece .model)')


def check_vocab(tok: Tokenizer, vocab_size: int, what: str = 'data.tokenizer') -> None:
  """Raises ValueError when the tokenizer has ids the model cannot output.

  A model vocabulary larger than the tokenizer's (padding, e.g. 264 for the
  byte tokenizer's 257) is fine.
  """
  if tok.vocab_size > vocab_size:
    name = "'' (byte-level)" if tok.byte_level else repr(tok.name)
    raise ValueError(f'{what}={name} has {tok.vocab_size} tokens but '
                     f'model.vocab_size={vocab_size}: the vocabularies do not match')


def for_checkpoint(path: str) -> str:
  """The tokenizer spec of the checkpoint at ``path`` ('' = byte-level).

  A tokenizer file in the checkpoint's top directory (``hf-import`` copies it
  there) wins; else the ``data.tokenizer`` of the run that wrote it, as given
  to that run, or found relative to its workdir.
  """
  # Orbax and JAX, which trainer.prepare's tokenizing workers do without:
  from trainer import checkpoint  # pylint: disable=g-import-not-at-top
  directory, _ = checkpoint.resolve(path)
  top = os.path.dirname(directory)
  for name in FILES:
    if os.path.isfile(os.path.join(top, name)):
      return os.path.join(top, name)
  spec = checkpoint.peek_meta(path).get('config', {}).get('data', {}).get('tokenizer', '')
  if spec and not os.path.exists(spec) and os.path.exists(os.path.join(top, spec)):
    return os.path.join(top, spec)
  return spec
