"""A word-level tokenizer for the mini model, built from the data it will read.

easy-VQA needs a few dozen words; a word-level vocabulary keeps every answer a
single token (so first-token scoring is exact) and the embedding table tiny.
The result is a regular `PreTrainedTokenizerFast`, so the mini model goes
through the same tokenizer API as LLaVA-1.5's.
"""

import re
from collections.abc import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vqa import IMAGE_PLACEHOLDER

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, IMAGE_PLACEHOLDER)
_WORD_OR_SYMBOL = re.compile(r"\w+|[^\w\s]")


def build_word_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Lower-cased word-level tokenizer whose vocabulary is every word and symbol in `texts`."""
    words = sorted({token for text in texts for token in _WORD_OR_SYMBOL.findall(text.lower())})
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Special tokens are matched before pre-tokenisation, so "<image>" stays one token.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens={"image_token": IMAGE_PLACEHOLDER},
    )
