"""``echo`` on completions at the gateway, against the fake engine's known outputs.

Each choice's text is its own prompt's text followed by the completion, streamed (the
first chunk of each choice carries the prompt) or not; several prompts with n > 1.
"""

from __future__ import annotations

from .conftest import MODEL
from .fake_engine import expected_text

PROMPTS = ["alpha one", "beta two three"]


async def test_echo_puts_each_prompt_before_its_completion(client):
    r = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, echo=True)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [p + expected_text(p.split()[0]) for p in PROMPTS for _ in range(2)]
    plain = await client.completions.create(model=MODEL, prompt=PROMPTS[0])
    assert plain.choices[0].text == expected_text("alpha")


async def test_streamed_echo_sends_the_prompt_first(client):
    stream = await client.completions.create(model=MODEL, prompt=PROMPTS, echo=True, stream=True)
    texts: dict[int, list[str]] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts.setdefault(c.index, []).append(c.text)
    for i, prompt in enumerate(PROMPTS):
        assert texts[i][0].startswith(prompt)
        assert "".join(texts[i]) == prompt + expected_text(prompt.split()[0])
