"""One smoke test on the real default model: the chat template, tokenizer and sampling all line up."""

import openai

from tests.server.harness import running_server


def test_chat_with_the_real_model(smollm2_engine):
    with running_server(smollm2_engine, served_model_name="smollm2-135m") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert r.usage.completion_tokens <= 24
