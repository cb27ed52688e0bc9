"""The benchmarks' corpus: a seeded synthetic dataset made of real English text.

Public-domain paragraphs built in (or any text file), each prompt sized to about N tokens
of a tokenizer; lengths drawn uniformly around a mean (vLLM's random dataset); an
optional system prompt every request shares (prefix caching). Real text keeps a
tokenizer's token/word ratio what it is on real prompts. No torch, no engine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

# Public-domain English prose (19th-century novels and essays, US founding texts).
# Real text keeps a tokenizer's token/word ratio what it is on real prompts.
PARAGRAPHS: tuple[str, ...] = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on "
    "his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
    "families, that he is considered the rightful property of some one or other of their daughters.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and "
    "see the watery part of the world. It is a way I have of driving off the spleen and regulating the "
    "circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly "
    "November in my soul, then, I account it high time to get to sea as soon as I can.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
    "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we "
    "had everything before us, we had nothing before us.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
    "to do: once or twice she had peeped into the book her sister was reading, but it had no pictures "
    "or conversations in it, and what is the use of a book, thought Alice, without pictures or "
    "conversations? So she was considering in her own mind, as well as she could, for the hot day made "
    "her feel very sleepy and stupid, whether the pleasure of making a daisy-chain would be worth the "
    "trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her.",
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any other "
    "name. In his eyes she eclipses and predominates the whole of her sex. It was not that he felt any "
    "emotion akin to love for Irene Adler. All emotions, and that one particularly, were abhorrent to "
    "his cold, precise but admirably balanced mind. He was, I take it, the most perfect reasoning and "
    "observing machine that the world has seen.",
    "You will rejoice to hear that no disaster has accompanied the commencement of an enterprise which "
    "you have regarded with such evil forebodings. I arrived here yesterday, and my first task is to "
    "assure my dear sister of my welfare and increasing confidence in the success of my undertaking. "
    "I am already far north of London, and as I walk in the streets of Petersburgh, I feel a cold "
    "northern breeze play upon my cheeks, which braces my nerves and fills me with delight.",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are "
    "engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war.",
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them "
    "to the separation.",
    "I went to the woods because I wished to live deliberately, to front only the essential facts of "
    "life, and see if I could not learn what it had to teach, and not, when I came to die, discover "
    "that I had not lived. I did not wish to live what was not life, living is so dear; nor did I wish "
    "to practise resignation, unless it was quite necessary.",
    "Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in "
    "confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an "
    "intrigue with a French girl, who had been a governess in their family, and she had announced to "
    "her husband that she could not go on living in the same house with him.",
    "The studio was filled with the rich odour of roses, and when the light summer wind stirred amidst "
    "the trees of the garden, there came through the open door the heavy scent of the lilac, or the "
    "more delicate perfume of the pink-flowering thorn. From the corner of the divan of Persian "
    "saddle-bags on which he was lying, smoking, as was his custom, innumerable cigarettes, Lord Henry "
    "Wotton could just catch the gleam of the honey-sweet and honey-coloured blossoms of a laburnum.",
    "Whether I shall turn out to be the hero of my own life, or whether that station will be held by "
    "anybody else, these pages must show. To begin my life with the beginning of my life, I record "
    "that I was born (as I have been informed and believe) on a Friday, at twelve o'clock at night. "
    "It was remarked that the clock began to strike, and I began to cry, simultaneously.",
    "In my younger and more vulnerable years my father gave me some advice that I've been turning over "
    "in my mind ever since. The sea was calm that morning, and the fishermen drew their boats up onto "
    "the shingle, mending nets and talking of the weather, of prices at the market, and of the great "
    "storm that had wrecked three ships off the headland in the winter before.",
    "There was no possibility of taking a walk that day. We had been wandering, indeed, in the leafless "
    "shrubbery an hour in the morning; but since dinner the cold winter wind had brought with it clouds "
    "so sombre, and a rain so penetrating, that further out-door exercise was now out of the question. "
    "I was glad of it: I never liked long walks, especially on chilly afternoons.",
    "The history of all hitherto existing society is the history of struggles between classes, wrote "
    "the economists of that century, while the engineers were busy laying railways across the plains, "
    "building bridges of iron over wide rivers, and stringing telegraph wires from one city to the "
    "next, so that news which once took weeks to travel now arrived within the hour.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed "
    "to unite some of the best blessings of existence; and had lived nearly twenty-one years in the "
    "world with very little to distress or vex her. She was the youngest of the two daughters of a "
    "most affectionate, indulgent father.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences (or clauses ending in . ! ? ; :) of ``text``, whitespace-normalised."""
    text = " ".join(text.split())
    return [s for s in _SENTENCE_END.split(text) if s]


def load_sentences(text_file: str | None = None) -> list[str]:
    """Sentences of a text file, or of the built-in paragraphs."""
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            sentences = split_sentences(f.read())
        if not sentences:
            raise ValueError(f"{text_file} holds no text")
        return sentences
    return [s for p in PARAGRAPHS for s in split_sentences(p)]


def draw_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """``n`` integers uniform in [mean*(1-r), mean*(1+r)], each at least 1 (vLLM's random dataset)."""
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def text_of_tokens(
    rng: random.Random, sentences: Sequence[str], num_tokens: int, encode: Encode, decode: Decode
) -> tuple[str, list[int]]:
    """Real text of exactly ``num_tokens`` tokens (as ``encode`` counts them, no specials).

    Random sentences are joined (starting at a random one, then in order, as a
    passage reads) until there are enough tokens; the ids are cut to ``num_tokens``
    and decoded. Returns (text, ids); re-encoding the text gives about, not always
    exactly, ``num_tokens`` ids (a word cut in two may merge differently).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    start = rng.randrange(len(sentences))
    parts: list[str] = []
    chars = 0
    i = 0
    # A token is at most a few characters of English: start from ~3 chars a token,
    # then add sentences four at a time until there are enough tokens. Each
    # sentence adds >= 1 token, so the bound below is only a guard.
    while chars < 3 * num_tokens:
        parts.append(sentences[(start + i) % len(sentences)])
        chars += len(parts[-1]) + 1
        i += 1
    ids = encode(" ".join(parts))
    for _ in range(num_tokens):
        if len(ids) >= num_tokens:
            break
        for _ in range(4):
            parts.append(sentences[(start + i) % len(sentences)])
            i += 1
        ids = encode(" ".join(parts))
    ids = ids[:num_tokens]
    return decode(ids), ids


@dataclass
class SampleRequest:
    prompt: str  # the user text (without the shared prefix)
    prompt_token_ids: list[int]  # ids of ``prompt`` (no specials)
    output_len: int
    prefix: str = ""  # the shared system prompt, "" if none


def make_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    encode: Encode,
    decode: Decode,
    seed: int = 0,
    shared_prefix_len: int = 0,
    text_file: str | None = None,
) -> list[SampleRequest]:
    """The seeded synthetic dataset: prompt and output lengths drawn uniformly with
    ``range_ratio`` spread; prompts are real text of about the drawn token count;
    ``shared_prefix_len`` > 0 gives every request the same system prompt of that size."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    sentences = load_sentences(text_file)
    input_lens = draw_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = draw_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = ""
    if shared_prefix_len > 0:
        prefix, _ = text_of_tokens(rng, sentences, shared_prefix_len, encode, decode)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, ids = text_of_tokens(rng, sentences, n_in, encode, decode)
        requests.append(SampleRequest(text, ids, n_out, prefix))
    return requests


def default_encoder(path: str | None = None):
    """``encode``, ``decode`` and the tokenizer of a model (default: the default model's)."""
    from shared.model_config import default_model_path
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(path or default_model_path())
    return (lambda s: tok.encode(s, add_special_tokens=False)), (lambda ids: tok.decode(ids)), tok
