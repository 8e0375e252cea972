"""easy-VQA fetched and verified by kvyard, and read with each question's type."""

from collections import Counter

from PIL import Image

from kvyard.vision.easy_vqa import answers, ensure_easy_vqa, read_split


def test_the_data_is_fetched_once_and_read_with_question_types():
    root = ensure_easy_vqa()
    assert ensure_easy_vqa() == root  # the second call reads the cache
    train, test = read_split("train"), read_split("test")
    assert (len(train), len(test)) == (38575, 9673)
    assert len({q.image for q in train}) == 4000 and len({q.image for q in test}) == 1000
    assert sorted(answers()) == sorted({q.answer for q in train})  # 13 answers, each used
    kinds = Counter(q.kind for q in train)
    assert set(kinds) == {"shape", "colour", "yes/no"} and kinds["yes/no"] > kinds["shape"]
    with Image.open(train[0].image) as image:
        assert image.size == (64, 64)
    assert (train[0].question, train[0].answer, train[0].kind) == ("what is the blue shape?", "rectangle", "shape")
