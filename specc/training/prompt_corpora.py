"""The prompts a data set's target answers: function openings from the standard library and chat
instructions from a topic x template grid, none equal to a benchmark prompt; and their token ids."""
from __future__ import annotations

import random

from ..prompts import CHAT, function_openings
from .data_config import DataConfig
from .stdlib_sources import stdlib_sources

TOPICS = (
    # nature and science
    "the moon", "volcanoes", "photosynthesis", "black holes", "rainbows", "glaciers", "earthquakes", "dinosaurs",
    "honey bees", "penguins", "coral reefs", "the immune system", "DNA", "tides", "lightning", "the solar system",
    "gravity", "magnets", "bacteria", "rain forests", "deserts", "migrating birds", "octopuses", "mushrooms",
    "the human heart", "the brain", "sleep", "vaccines", "nutrition", "climate change", "wind power", "nuclear energy",
    "solar panels", "electric cars", "batteries", "the speed of light", "atoms", "chemical reactions", "fossils",
    # history and culture
    "the Roman empire", "the printing press", "the French revolution", "ancient Egypt", "the Silk Road",
    "the Renaissance", "the industrial revolution", "the moon landing", "the Olympic games", "jazz music",
    "classical music", "impressionist painting", "Shakespeare's plays", "Greek mythology", "the Great Wall of China",
    "the invention of the telephone", "the history of money", "medieval castles", "the Vikings", "world war one",
    # everyday life
    "coffee", "bread baking", "gardening", "origami", "kites", "recycling", "time management", "public speaking",
    "saving money", "learning a language", "job interviews", "moving to a new city", "first aid", "camping",
    "cooking rice", "houseplants", "running a marathon", "meditation", "board games", "photography", "knitting",
    "budget travel", "writing a resume", "making friends as an adult", "caring for a dog", "cycling to work",
    # computing
    "sorting algorithms", "git branches", "unit tests", "SQL joins", "linked lists", "regular expressions",
    "HTTP requests", "password security", "the internet", "recursion in programming", "hash functions",
    "binary numbers", "operating systems", "compilers", "cloud computing", "machine learning", "neural networks",
    "databases", "REST APIs", "Python decorators", "Python generators", "JavaScript promises", "Docker containers",
    "code reviews", "version control", "big O notation", "encryption", "computer viruses", "open source software",
    "floating point numbers", "garbage collection", "multithreading", "caching", "spreadsheets", "the stock market",
    # ideas
    "democracy", "the scientific method", "logical fallacies", "probability", "prime numbers", "infinity",
    "fractions", "statistics", "supply and demand", "inflation", "ethics of AI", "friendship", "happiness",
)


TEMPLATES = (
    "Explain {} in simple terms.", "Write a short paragraph about {}.", "Give me three facts about {}.",
    "What are common misconceptions about {}?", "Write a haiku about {}.", "How would you teach {} to a child?",
    "List the pros and cons of {}.", "Write a short story that involves {}.",
    "What questions do beginners ask about {}?", "Summarize the history of {}.",
    "Describe {} to someone from the year 1800.", "Write a limerick about {}.",
    "What is the most surprising thing about {}?", "Give me a one-sentence definition of {}.",
    "Why does {} matter?", "How does {} work?", "Write a short poem about {}.", "Tell me a fun fact about {}.",
    "Compare {} with something from everyday life.", "What should I read to learn about {}?",
    "Write a tweet about {}.", "Explain {} like I am a university student.", "What are five key terms about {}?",
    "Write a dialogue between two friends about {}.", "Give me a quiz question about {} with its answer.",
    "What are the biggest open problems around {}?", "Write a product description inspired by {}.",
    "Outline a ten-minute talk on {}.", "What would change if {} did not exist?",
    "Give me three tips related to {}.", "Write an encouraging note to someone studying {}.",
    "Explain {} in exactly three sentences.",
)


def training_prompts(cfg: DataConfig) -> list[tuple[str, bool]]:
    """(text, chat) pairs: function openings from the whole standard library except the benchmark's
    modules, and chat instructions from a topic x template grid (none equal to a benchmark prompt)."""
    rng = random.Random(cfg.seed)
    code = []
    for path in stdlib_sources():
        try:
            code += function_openings(path.read_text(encoding="utf-8"), decorators=False, dunders=True)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
    rng.shuffle(code)
    chat = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    chat = [p for p in chat if p not in CHAT]
    rng.shuffle(chat)
    return ([(p, False) for p in code[cfg.code_from:cfg.code_from + cfg.n_code]]
            + [(p, True) for p in chat[cfg.chat_from:cfg.chat_from + cfg.n_chat]])


def encode(tokenizer, text: str, chat: bool, limit: int) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids)[-limit:]
