"""The caption scorer of the reference LMM (tools/reference/evaluate.py) on hand-written captions:
what counts as naming an object, a wrong object and an invented topic."""
from __future__ import annotations

from tools.reference.evaluate import ALLOWED_WORDS, invented_words, score

CLIP = [{"colour": "red", "shape": "triangle"}, {"colour": "orange", "shape": "cross"}]


def test_a_caption_that_describes_the_clip_passes():
    for text in ("The video shows a red triangle and an orange cross.",
                 "A red triangle moves left; an orange cross appears in frame 5 and moves up.",
                 "The video features two shapes on a plain white background: a red triangle and an orange cross."):
        result = score(text, CLIP)
        assert result["named"] and result["first"], text
        assert not result["invented"] and not result["wrong_object"], (text, invented_words(text))
        assert result["colour_recall"] == result["shape_recall"] == 1.0


def test_naming_needs_colour_and_shape_of_one_object():
    assert score("An orange triangle.", CLIP)["named"] is False  # colour of one, shape of the other
    assert score("A red shape and a cross.", CLIP)["named"] is False
    named = score("Two orange crosses.", CLIP)  # plurals count
    assert named["named"] and not named["first"]  # the reference caption starts with the red triangle
    assert score("A RED TRIANGLE.", CLIP)["named"]  # case does not matter
    assert score("A red, small triangle.", CLIP)["named"]  # one word may come between
    swapped = score("An orange triangle and a red cross.", CLIP)  # every word of the clip, wrongly paired
    assert not swapped["named"] and swapped["colour_recall"] == swapped["shape_recall"] == 1.0
    assert not score("A red and an orange shape, a triangle and a cross.", CLIP)["named"]


def test_topics_the_clip_does_not_show_are_invented():
    zelda = 'The video is a 2019-themed video game called "The Legend of Zelda: zeldaedra".'
    assert invented_words(zelda) == ["themed", "game", "called", "legend", "zelda", "zeldaedra"]
    person = "The video shows a person wearing a red triangle."
    assert invented_words(person) == ["person", "wearing"]
    assert score(person, CLIP)["named"] and score(person, CLIP)["invented"]  # both can hold
    assert invented_words("The video shows a red triangle in 8 frames.") == []  # digits are counts


def test_wrong_colours_and_shapes_are_reported_apart_from_invented_topics():
    result = score("The video shows a red triangle and a blue star.", CLIP)
    assert result["named"] and result["wrong_object"] and result["wrong_colour"] and not result["invented"]
    assert score("A red circle.", CLIP)["wrong_object"] and not score("A red circle.", CLIP)["wrong_colour"]


def test_allowed_words_hold_no_topic_nouns():
    for word in ("person", "game", "story", "man", "woman", "people", "animation", "symbol", "celestial", "narrative"):
        assert word not in ALLOWED_WORDS
