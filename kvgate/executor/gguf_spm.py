"""SentencePiece-style vocabularies in GGUF files (``tokenizer.ggml.model = llama``): Llama 2,
Mistral, Phi-3, Gemma.

The file stores each piece's text (``▁`` for a space), a score and a type (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte ``<0xNN>``), but no merges.
SentencePiece's BPE encodes a word by repeatedly joining the adjacent pair whose joined text is
the highest-scoring piece; characters no piece covers become their UTF-8 byte pieces. The
``tokenizers`` library runs the same algorithm as a BPE model whose merges are ranked by the
joined piece's score (best first) with ``byte_fallback``; :func:`ranked_merges` builds that list:
every split of every normal piece into two pieces of the vocabulary.

Around the model, as the published ``tokenizer.json`` of these models and llama.cpp do it:

- ``add_space_prefix`` (default true, Gemma false): a ``▁`` is put before the text of every
  segment between added tokens, and every space becomes ``▁`` (a normalizer: SentencePiece's
  "dummy prefix"); decoding turns ``▁`` back into spaces and drops the first one. transformers'
  own GGUF reader uses its Metaspace pre-tokenizer instead for ``llama`` files, which differs
  on text that starts with a space (``"  hi"``: ``▁▁▁hi`` here and in llama.cpp, ``▁▁hi``
  there) and on text right after a special token (no prefix there);
- Gemma: pieces of two or more spaces are stored with real spaces (the converter pre-normalizes
  user-defined pieces); they are spelled back with ``▁`` and joined by merges like any piece,
  and the merges are ranked by the pieces' order in the file (Gemma's scores do not follow its
  merge order; transformers' GGUF reader does the same, and the tests compare against it).
"""

from __future__ import annotations

from enum import Enum

from tokenizers import Tokenizer, decoders, models, normalizers

from kvgate.executor.checkpoint_error import CheckpointError
from kvgate.executor.gguf_metadata import GgufMetadata

SPACE = "\u2581"  # ▁, SentencePiece's visible space
NORMAL_TOKEN = 1
UNKNOWN_TOKEN = 2
USER_DEFINED_TOKEN = 4
_FILE_ORDER_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


class MergeOrder(Enum):
    """How two applicable merges are ranked: the joined piece's score, or its place in the file."""

    SCORE = "score"
    FILE = "file"


def sentencepiece_tokenizer(
    meta: GgufMetadata, tokens: list[str], types: list[int]
) -> tuple[Tokenizer, list[str], list[int]]:
    """The BPE tokenizer (without added tokens), and the pieces and types as it reads them."""
    name = meta.path.name
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise CheckpointError(f"{name}: remove_extra_whitespaces is not supported")
    if meta.get("tokenizer.ggml.precompiled_charsmap") is not None:
        raise CheckpointError(
            f"{name}: a SentencePiece normalization table (precompiled_charsmap) is not supported"
        )
    scores = [float(s) for s in meta.require("tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise CheckpointError(f"{name}: {len(scores)} token scores for {len(tokens)} tokens")
    order = MergeOrder.FILE if meta.architecture in _FILE_ORDER_ARCHITECTURES else MergeOrder.SCORE
    pieces, types = list(tokens), list(types)
    if order is MergeOrder.FILE:
        pieces, types = _spell_spaces(tokens, types)
    vocab = {piece: index for index, piece in reversed(list(enumerate(pieces)))}
    merges = ranked_merges(pieces, types, scores, order)
    unknown = next((pieces[i] for i, t in enumerate(types) if t == UNKNOWN_TOKEN), None)
    try:
        model = models.BPE(
            vocab=vocab, merges=merges, unk_token=unknown, fuse_unk=True, byte_fallback=True
        )
    except Exception as exc:  # the library raises a bare Exception for inconsistent merges
        raise CheckpointError(
            f"{name}: the SentencePiece vocabulary is inconsistent: {exc}"
        ) from exc
    tokenizer = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Replace(" ", SPACE)]
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), *spaces] if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, pieces, types


def ranked_merges(
    pieces: list[str], types: list[int], scores: list[float], order: MergeOrder
) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose join is a normal piece and whose halves are pieces, best
    join first (ties: the earlier piece, then the longer left half)."""
    index = {piece: i for i, piece in reversed(list(enumerate(pieces)))}
    ranked: list[tuple[tuple[float, int, int], tuple[str, str]]] = []
    for joined_id, piece in enumerate(pieces):
        if types[joined_id] != NORMAL_TOKEN or index.get(piece) != joined_id:
            continue
        rank = -scores[joined_id] if order is MergeOrder.SCORE else 0.0
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append(((rank, joined_id, -cut), (left, right)))
    ranked.sort(key=lambda entry: entry[0])
    return [merge for _, merge in ranked]


def _spell_spaces(tokens: list[str], types: list[int]) -> tuple[list[str], list[int]]:
    """User-defined pieces made only of spaces, spelled with ``▁`` and read as normal pieces,
    unless that spelling is already taken."""
    taken = set(tokens)
    pieces, kinds = list(tokens), list(types)
    for i, token in enumerate(tokens):
        spelled = SPACE * len(token)
        only_spaces = bool(token) and not token.strip(" ")
        if kinds[i] == USER_DEFINED_TOKEN and only_spaces and spelled not in taken:
            pieces[i], kinds[i] = spelled, NORMAL_TOKEN
            taken.add(spelled)
    return pieces, kinds
