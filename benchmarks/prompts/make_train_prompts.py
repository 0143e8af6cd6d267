"""Writes the prompt set the shipped DSpark drafter was trained on (`train_dspark.txt`).

Chat requests of the kinds people send a small assistant (explain, list, compare, write, plan,
code, small sums), built from task templates and hand-written topics, shuffled with a fixed seed.
Nothing here comes from a data set. Prompts that touch a subject of the held-out benchmark
prompts (`chat.txt`, `copy_edit.txt`) are left out, so the benchmark measures the drafter on
requests it has not seen: `held_out_subjects` lists them and a test checks the file against them.

    python benchmarks/prompts/make_train_prompts.py            # rewrites train_dspark.txt
    python benchmarks/prompts/make_train_prompts.py --self 2500  # writes train_dspark_self.txt

`--self N` asks the model itself for requests instead (as Magpie does): the model continues
its chat template up to where a user's message begins, sampled (temperature 1.0, top_p 0.95,
a seed per request), and what it writes as that message is a request in the model's own
idiom, on whatever subjects it brings up. Kept: one line of 6 to 60 words that does not end
mid-sentence (",", ":", "-"), once each, none touching a held-out subject.
"""

from __future__ import annotations

import argparse
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent

# Subjects of the held-out prompts (lower case): a training prompt containing one is dropped.
HELD_OUT_SUBJECTS = (
    "weather", "climate", "houseplant", "celsius", "fahrenheit", "birthday", "sky", "tuple", "bakery",
    "minutes", "week", "cat ", "cats", "hiking", "riding hood", "leap year", "soup", "guitar", "noun",
    "verb", "adjective", "ocean", "lighthouse", "bread", "committee", "typo", "print button", "monday",
)

SCIENCE = """photosynthesis; gravity; electricity; magnetism; volcanoes; earthquakes; the water cycle; rainbows;
the moon's phases; tides; black holes; the solar system; stars; comets; DNA; cells; the immune system;
vaccines; bacteria; viruses; evolution; dinosaurs; fossils; atoms; molecules; chemical reactions; acids and
bases; sound waves; light; lenses; friction; inertia; energy; batteries; solar panels; wind turbines;
nuclear power; the greenhouse effect; glaciers; deserts; rainforests; coral reefs; bees; ants; bats;
whales' migration; bird migration; the human heart; the brain; sleep; dreams; muscles; bones; digestion;
the lungs; blood types; vitamins; protein; metabolism; allergies; the speed of light; the Big Bang;
Mars; Jupiter; satellites; rockets; the periodic table; plastics; recycling; compost; soil; clouds;
lightning; hurricanes; tornadoes; snowflakes; magnets; thermometers; microscopes; telescopes""".split(";")

TECH = """the internet; email; Wi-Fi; Bluetooth; GPS; smartphones; computer memory; hard drives; CPUs;
operating systems; passwords; two-factor authentication; encryption; cloud storage; web browsers; HTML;
CSS; JavaScript; SQL databases; version control with git; open source software; APIs; machine learning;
neural networks; search engines; spreadsheets; backups; computer viruses; phishing; QR codes; barcodes;
3D printers; robots; electric cars; self-driving cars; video compression; streaming music; e-books;
digital cameras; touch screens; keyboards; recursion; binary numbers; sorting algorithms; hash tables;
unit tests; debugging; regular expressions; the command line; Linux; Python dictionaries; Python
generators; list comprehensions; classes and objects; exceptions; JSON; CSV files; web servers; caching""".split(";")

EVERYDAY = """saving money; making a budget; cooking rice; baking cookies; making pancakes; brewing coffee;
making tea; planting tomatoes; growing herbs; cleaning a kitchen; doing laundry; ironing a shirt;
organizing a closet; moving to a new city; renting an apartment; job interviews; writing a resume;
learning a new language; studying for exams; taking notes; time management; morning routines; staying
motivated; drinking enough water; stretching; running a first 5k; swimming; cycling to work; yoga;
meditation; reading more books; keeping a journal; writing letters; making friends; being a good
listener; public speaking; giving feedback; asking for a raise; working from home; video calls; packing
for a beach holiday; travelling by train; camping; fishing; painting a room; fixing a flat bicycle tire;
caring for a dog; adopting a rabbit; feeding birds in the garden; keeping fish in an aquarium; first
aid for a small cut; treating a sunburn; preparing for a power cut; choosing a laptop; choosing running
shoes; buying a used car; hosting a dinner party; planning a wedding; teaching a child to read;
learning to swim; learning to draw; learning chess; playing the piano; singing; photography; knitting""".split(";")

HISTORY = """the Roman Empire; ancient Egypt; the pyramids; the Great Wall of China; the printing press; the
Renaissance; the Industrial Revolution; the steam engine; the invention of the telephone; the first
airplane; the Moon landing; the Olympic Games; the Silk Road; the Vikings; medieval castles; knights;
the French Revolution; the history of money; the history of writing; the invention of paper; the
compass; the wheel; windmills; the history of chocolate; the history of tea; the history of coffee;
the history of the bicycle; Leonardo da Vinci; Marie Curie; Isaac Newton; Albert Einstein; Ada
Lovelace; Charles Darwin; Galileo; William Shakespeare; Mozart; Beethoven; Vincent van Gogh; Frida
Kahlo; the Mona Lisa; jazz; the Beatles; the history of football; chess""".split(";")

IDEAS = """democracy; taxes; inflation; interest rates; supply and demand; a stock; a bond; insurance;
renewable energy; fair trade; kindness; honesty; patience; curiosity; creativity; leadership;
teamwork; friendship; happiness; gratitude; habits; procrastination; stress; boredom; courage;
empathy; critical thinking; the scientific method; statistics; probability; averages; percentages;
fractions; prime numbers; the Pythagorean theorem; algebra; geometry; infinity; zero; negative
numbers; compound interest; maps; time zones; calendars; languages; dialects; poetry; metaphors;
rhyme; storytelling; libraries; museums; zoos; national parks; cities; villages; islands; rivers;
mountains; forests; volcanic islands; the seasons""".split(";")

TOPICS = [t.strip().replace("\n", " ") for group in (SCIENCE, TECH, EVERYDAY, HISTORY, IDEAS) for t in group]
EXPLAINABLE = [t.strip().replace("\n", " ") for group in (SCIENCE, TECH, HISTORY, IDEAS) for t in group]
ACTIVITIES = [t.strip().replace("\n", " ") for t in EVERYDAY]

EXPLAIN = (
    "Explain {t} in simple terms.", "What is {t}?", "Explain {t} to a ten-year-old.",
    "Give me a short overview of {t}.", "Why is {t} important?", "What are three interesting facts about {t}?",
    "Describe {t} in one paragraph.", "What do most people get wrong about {t}?",
    "Write a short quiz with three questions about {t}, with answers.", "Summarize what you know about {t}.",
    "How would you teach {t} to a beginner?", "What are the pros and cons of {t}?",
    "Write a haiku about {t}.", "Write a short poem about {t}.", "Write a short story that involves {t}.",
    "Give an analogy that explains {t}.", "What questions should I ask to understand {t} better?",
)
DO = (
    "Give me tips for {t}.", "How do I get started with {t}?", "What are common mistakes in {t}?",
    "Make a step-by-step plan for {t}.", "List five things to know about {t}.",
    "What equipment or materials do I need for {t}?", "How can I get better at {t}?",
    "Write a checklist for {t}.", "Explain the basics of {t}.", "What is the easiest way to approach {t}?",
    "I have one hour. How should I spend it on {t}?", "Write a short motivational note about {t}.",
)
COMPARE = (
    "Compare {a} and {b}.", "What is the difference between {a} and {b}?",
    "Which is more useful to learn about first, {a} or {b}? Explain.", "How are {a} and {b} related?",
)
WRITE = (
    "Write a polite email asking a colleague for help with {t}.", "Write a short product description for a book about {t}.",
    "Write a tweet about {t}.", "Write a short speech introducing {t} to a class.",
    "Write a dialogue between two friends talking about {t}.", "Write a limerick about {t}.",
    "Write an encouraging message to someone who is struggling with {t}.",
)
CODE = (
    "Write a Python function that {c}.", "How do I {c} in Python?", "Write a JavaScript function that {c}.",
    "Explain how to write a program that {c}.", "Write a Python function that {c}, with a docstring and an example.",
)
CODE_TASKS = """reverses a string; checks whether a number is prime; counts the vowels in a string; finds the largest
number in a list; sorts a list of names; removes duplicates from a list; computes the factorial of a
number; returns the Fibonacci numbers up to n; checks whether a word is a palindrome; merges two
dictionaries; reads a text file and counts its lines; converts a list of numbers to their squares;
finds the average of a list; flattens a nested list; capitalizes every word in a sentence; computes the
greatest common divisor of two numbers; converts kilometres to miles; checks whether a year is
divisible by four; finds the second smallest number in a list; counts word frequencies in a text; splits a
list into chunks of size n; validates an email address; generates a random password; rotates a list by k
positions; finds common elements of two lists; sums the digits of a number; converts a number to
binary; checks whether two strings are anagrams; finds the longest word in a sentence; groups a list of
words by their first letter""".split(";")
MATH = (
    "A shop sells apples at {p} cents each. How much do {n} apples cost? Show your working.",
    "If a train travels {n} kilometres in {h} hours, what is its average speed?",
    "What is {n} percent of {m}? Explain the steps.", "I have {m} marbles and give away {n}. How many are left?",
    "A rectangle is {n} metres long and {h} metres wide. What are its area and perimeter?",
    "Split {m} euros equally among {h} people. How much does each get?",
    "What is {n} multiplied by {h}? Explain how to do it in your head.",
    "If I save {n} dollars every month, how much will I have after {h} years?",
)


def prompts(seed: int = 0) -> list[str]:
    """Every prompt of the set, in a fixed shuffled order."""
    rng = random.Random(seed)
    out = [template.format(t=t) for t in EXPLAINABLE for template in rng.sample(EXPLAIN, 6)]
    out += [template.format(t=t) for t in ACTIVITIES for template in rng.sample(DO, 6)]
    out += [template.format(t=t) for t in TOPICS for template in rng.sample(WRITE, 1)]
    for _ in range(300):
        a, b = rng.sample(TOPICS, 2)
        out.append(rng.choice(COMPARE).format(a=a, b=b))
    out += [template.format(c=c.strip().replace("\n", " ")) for c in CODE_TASKS for template in rng.sample(CODE, 3)]
    for _ in range(200):
        out.append(rng.choice(MATH).format(p=rng.randint(5, 90), n=rng.randint(2, 60), m=rng.randint(60, 900),
                                           h=rng.randint(2, 9)))
    out = [p[0].upper() + p[1:] for p in dict.fromkeys(out) if not held_out(p)]
    rng.shuffle(out)
    return out


def held_out(prompt: str) -> bool:
    """Whether a prompt touches a subject of the held-out benchmark prompts."""
    text = prompt.lower() + " "
    return any(subject in text for subject in HELD_OUT_SUBJECTS)


def self_prompts(count: int, seed: int = 0, model: str | None = None, batch: int = 64) -> list[str]:
    """`count` requests the model writes itself (see the module's docstring), in order of seed;
    asks for more until that many pass the filters (at most 4x count tries)."""
    from weld import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch, max_model_len=512)
    template = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                                      add_generation_prompt=False)
    prefix = template[:template.index("\x00")]  # everything before the user's words
    out: dict[str, None] = {}
    tried = 0
    while len(out) < count and tried < 4 * count:
        n = min(4 * batch, 4 * count - tried)
        params = [SamplingParams(max_tokens=80, temperature=1.0, top_p=0.95, seed=seed * 1_000_003 + tried + i,
                                 stop=["\n"]) for i in range(n)]
        for request in llm.generate([prefix] * n, params, use_tqdm=False):
            text = " ".join(request.outputs[0].text.split())
            if (request.outputs[0].finish_reason == "stop" and 6 <= len(text.split()) <= 60
                    and text[-1] not in ",:-" and not held_out(text)):
                out.setdefault(text)
        tried += n
        print(f"{len(out)} kept of {tried}", flush=True)
    return list(out)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--self", dest="self_count", type=int, default=0, metavar="N",
                        help="write N requests the model writes itself (default out: train_dspark_self.txt)")
    parser.add_argument("--model", default=None, help="with --self: the model (default: the bundled one)")
    parser.add_argument("--batch", type=int, default=64,
                        help="with --self: requests written at once (the engine's max_num_seqs; default: 64)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 0 <= args.self_count <= 100_000:
        parser.error("--self takes 0..100000")
    if not 1 <= args.batch <= 4096:
        parser.error("--batch takes 1..4096")
    if args.self_count:
        items = self_prompts(args.self_count, args.seed, args.model, args.batch)
        args.out = args.out or str(HERE / "train_dspark_self.txt")
    else:
        items = prompts(args.seed)
        args.out = args.out or str(HERE / "train_dspark.txt")
    pathlib.Path(args.out).write_text("\n".join(items) + "\n", encoding="utf-8")
    print(f"{len(items)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
