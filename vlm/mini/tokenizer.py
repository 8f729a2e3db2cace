"""A word-level tokenizer for the mini model, built from the data it will read.

easy-VQA needs a few dozen words; a word-level vocabulary keeps every answer a
single token (so first-token scoring is exact) and the embedding table tiny.
The result is a regular `PreTrainedTokenizerFast`, so the mini model goes
through the same tokenizer API as LLaVA-1.5's.

`build_sample_tokenizer` is the one rule for a model without a tokenizer of its own
(random weights): every party of a run, the attacks' rebuild of it (training.data)
and the DTP preparation (pruning.prepare) read the same words from the same samples.
"""

import re
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vqa import IMAGE_PLACEHOLDER, VQASample, build_prompt

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


def build_sample_tokenizer(samples: Sequence[VQASample]) -> PreTrainedTokenizerFast:
    """The word tokenizer over every question (as prompted, without an instruction line) and answer of `samples`."""
    return build_word_tokenizer(build_prompt(s.question, instruction="") + " " + s.answer for s in samples)
