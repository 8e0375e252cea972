"""A graft served (`kvyard serve --model GRAFTDIR`): an image request equals HF given the same soft tokens in the
training prompt's places; without an image the output is the plain model's, byte for byte, and the encoder never
runs; images are cached by content and their hash keys the prefix cache; bad images get 400s."""

import base64
import io
import json

import openai
import pytest
import torch
from PIL import Image, ImageDraw

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import build_configs
from kvyard.vision.encoder import normalise
from kvyard.vision.graft import PLACEHOLDER, GraftFormat, embeddings
from kvyard.vision.images import pixels
from tests.conftest import hf_reference
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server
from tests.vision.conftest import TOKENS

QUESTION = "What shape is in the image?"


def png(colour: str = "red", size: int = 64, shape: str = "circle") -> bytes:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    (draw.ellipse if shape == "circle" else draw.rectangle)((12, 12, size - 12, size - 12), fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("llama")))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def served(engine, graft_dir):
    with running_server(engine, graft=str(graft_dir), served_model_name="graft") as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(server, messages: list[dict], **extra) -> openai.types.chat.ChatCompletion:
    return client(server).chat.completions.create(model="graft", messages=messages, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True}, **extra)


def test_the_served_model_is_the_grafts_language_model(graft_dir, tiny_checkpoint):
    engine_config, settings = build_configs(None, {"model": str(graft_dir)}, {})
    assert engine_config.model == str(tiny_checkpoint("llama"))
    assert settings.graft == str(graft_dir) and settings.served_model_name == graft_dir.name


def test_an_image_request_equals_hf_given_the_same_soft_tokens(served, tiny_checkpoint):
    image = png()
    got = ask(served, image_message(data_url(image)))
    # The oracle: HF on the training prompt's token ids, the projector's soft tokens in the placeholders' places
    vision = served.ctx.vision
    tokenizer = load_checkpoint(tiny_checkpoint("llama")).tokenizer
    fmt = GraftFormat(tokenizer, TOKENS)
    prompt = fmt.prompt(QUESTION, True)
    with torch.no_grad():
        rgb = Image.open(io.BytesIO(image)).convert("RGB")
        soft = vision.projector(vision.encoder.features(normalise(pixels(rgb, 64)[None])))
        lm = hf_reference(tiny_checkpoint("llama"))
        embeds, mask, _ = embeddings(lm, [prompt], soft, [[]], fmt.placeholder_id)
        ids = lm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got.usage.prompt_tokens == len(prompt.ids)
    assert got.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    # ... and the image mattered: the same question without it says something else
    assert ask(served, [{"role": "user", "content": f"{PLACEHOLDER}\n{QUESTION}"}]).choices[0].message.content \
        != got.choices[0].message.content


def test_without_an_image_the_output_is_the_plain_models_byte_for_byte(served, tiny_checkpoint):
    # A prompt neither engine has seen: a prefix-cache hit may move a logprob in its last float bit
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name three shapes, no images."}]}]
    runs = served.ctx.vision.encoder_runs
    with_graft = ask(served, messages, logprobs=True, top_logprobs=3)
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("llama")))
    try:
        with running_server(engine, served_model_name="graft") as plain:
            without = ask(plain, messages, logprobs=True, top_logprobs=3)
    finally:
        engine.shutdown()
    assert served.ctx.vision.encoder_runs == runs  # the encoder never ran
    assert json.dumps(with_graft.choices[0].model_dump()) == json.dumps(without.choices[0].model_dump())
    assert with_graft.usage == without.usage


def test_images_are_cached_by_content_and_their_hash_keys_the_prefix_cache(served, engine):
    vision, blocks = served.ctx.vision, engine._engine.blocks
    question = "Describe the image in detail, please, with its colours and shapes and sizes."
    first = png("blue", shape="square")
    runs, hits, cached = vision.encoder_runs, vision.cache_hits, blocks.hit_tokens
    answer = ask(served, image_message(data_url(first), question)).choices[0].message.content
    assert blocks.hit_tokens == cached and vision.encoder_runs == runs + 1
    cached = blocks.hit_tokens
    assert ask(served, image_message(data_url(first), question)).choices[0].message.content == answer
    assert vision.encoder_runs == runs + 1 and vision.cache_hits == hits + 1
    assert blocks.hit_tokens - cached >= 16  # the same image: its blocks are shared
    cached = blocks.hit_tokens
    ask(served, image_message(data_url(png("green", shape="square")), question))
    assert vision.encoder_runs == runs + 2
    assert blocks.hit_tokens == cached  # another image in the first block: nothing is shared


def _bmp() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="BMP")
    return out.getvalue()


def _tall_png() -> bytes:
    out = io.BytesIO()
    Image.new("1", (5000, 1)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(("url", "says"), [
    ("https://example.com/cat.png", "remote image URLs are refused"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,!!!notbase64", "not valid base64"),
    (data_url(_bmp(), "image/bmp"), "neither a PNG nor a JPEG"),
    (data_url(png()[:200]), "does not decode"),
    (data_url(_tall_png()), "at most 4096 a side"),
])
def test_bad_images_get_400s_and_lose_nothing(served, url, says):
    with pytest.raises(openai.BadRequestError) as e:
        ask(served, image_message(url))
    assert says in e.value.message
    assert ask(served, image_message(data_url(png()))).choices[0].finish_reason == "length"  # still serving


def test_requests_the_graft_cannot_take_get_400s(served, engine):
    with pytest.raises(openai.BadRequestError, match="at most 8 images"):
        ask(served, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png())}}] * 9}])
    with pytest.raises(openai.BadRequestError, match="reserved for images"):
        ask(served, image_message(data_url(png()), f"Is {PLACEHOLDER} a word?"))
    with pytest.raises(openai.BadRequestError, match="images go in user messages"):
        ask(served, [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(png())}}]},
                     {"role": "user", "content": QUESTION}])
    with running_server(engine, served_model_name="graft") as plain, \
            pytest.raises(openai.BadRequestError, match="takes no images"):
        ask(plain, image_message(data_url(png())))
