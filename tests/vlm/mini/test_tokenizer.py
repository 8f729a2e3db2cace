from vlm.mini.attributes import COLORS, SHAPES
from vlm.mini.tokenizer import build_word_tokenizer
from vqa import IMAGE_PLACEHOLDER, build_prompt

ANSWERS = ["yes", "no", *SHAPES, *COLORS]


def make_tokenizer():
    return build_word_tokenizer([build_prompt("What color is the shape?", None), *ANSWERS])


def test_every_answer_is_one_known_token():
    tokenizer = make_tokenizer()
    for answer in ANSWERS:
        ids = tokenizer(" " + answer)["input_ids"]
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, answer


def test_image_placeholder_stays_one_token_inside_a_prompt():
    tokenizer = make_tokenizer()
    ids = tokenizer(build_prompt("what color is the shape?", None))["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    assert ids.count(image_id) == 1
    assert tokenizer.image_token == IMAGE_PLACEHOLDER


def test_unknown_words_map_to_unk_and_case_is_ignored():
    tokenizer = make_tokenizer()
    assert tokenizer("WHAT Color")["input_ids"] == tokenizer("what color")["input_ids"]
    assert tokenizer("zebra")["input_ids"] == [tokenizer.unk_token_id]


def test_save_and_reload_gives_the_same_ids(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = build_prompt("is there a blue circle?", None) + " yes"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.image_token == IMAGE_PLACEHOLDER
