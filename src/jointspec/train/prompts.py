"""Training prompts that ship with the package and do not overlap the benchmark sets.

A drafter trained on MT-Bench or HumanEval questions would be measured on its own training data, so the default
training mix is built from two licence-clean sources instead:

* **chat**: instructions assembled from task templates and topics written for this project (writing, roleplay,
  reasoning, math, coding, extraction, STEM, humanities: the MT-Bench categories, none of its questions);
* **code**: HumanEval-shaped completion tasks ("Complete this Python function" + signature + docstring) cut from
  functions of the Python standard library installed on this machine (PSF licence), selected with a fixed seed.

Only prompts are built here. The target writes the answers (self-distillation), see :mod:`jointspec.train.data`.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

_TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "machine learning", "climate change", "the immune system",
    "the Roman Empire", "quantum computing", "volcanoes", "the stock market", "renewable energy", "the printing press",
    "honeybees", "plate tectonics", "the human brain", "cryptography", "ocean currents", "the Silk Road",
    "electric cars", "vaccines", "the water cycle", "Shakespeare's plays", "the Industrial Revolution", "coral reefs",
    "inflation", "the internet", "DNA replication", "the Moon landing", "jazz music", "urban gardening",
    "sleep", "the Great Wall of China", "recycling", "supply and demand", "the theory of evolution", "earthquakes",
    "social media", "ancient Egypt", "solar panels", "the Olympic Games", "antibiotics", "impressionist painting",
    "the Cold War", "coffee", "rainforests", "public libraries", "space telescopes", "chess", "bread baking",
    "remote work", "migratory birds", "the periodic table", "democracy", "nuclear fusion", "mountaineering",
]
_CHAT_TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short blog post about {t}.", "Give me five interesting facts about {t}.",
    "What are the main advantages and disadvantages of {t}?", "Write a haiku about {t}.",
    "Summarise the history of {t} in one paragraph.", "Write a persuasive paragraph arguing that everyone should "
    "learn about {t}.", "Pretend you are a tour guide and introduce {t} to visitors.",
    "Write a short dialogue between a teacher and a student about {t}.", "What are common misconceptions about {t}?",
    "Describe {t} in three sentences, then list two open questions about it.",
    "Write an email to a friend recommending a book about {t}.", "How would you explain {t} using an analogy?",
    "Create a quiz with three multiple-choice questions about {t}.", "Write a limerick about {t}.",
    "What careers are related to {t}? Give a short description of each.",
    "Compare {t} with {u} in a short table, then explain the key difference.",
    "Act as a journalist and write the opening paragraph of a news story about {t}.",
    "List the steps someone should take to start learning about {t}.",
    "Write a product description for an educational toy about {t}.",
]
_MATH_TEMPLATES = [
    "What is {a} multiplied by {b}? Show your work.", "Solve for x: {a}x + {b} = {c}.",
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "What is the sum of the integers from 1 to {a}?", "Is {c} a prime number? Explain how you checked.",
    "A rectangle has sides {a} cm and {b} cm. What are its area and perimeter?",
    "Convert {a} degrees Celsius to Fahrenheit.", "What is {a} percent of {c}?",
    "Alice has {a} apples and gives {b} to Bob. Bob already had {c}. How many apples does each have now?",
]
_REASONING_TEMPLATES = [
    "If all {x} are {y} and some {y} are green, can we conclude that some {x} are green? Explain.",
    "Tom is taller than Sam, and Sam is taller than Ann. Who is the shortest? Explain your reasoning.",
    "A farmer has {a} sheep and all but {b} run away. How many are left? Think step by step.",
    "What comes next in the sequence {a}, {d}, {e}, ...? Explain the rule.",
    "You have two ropes that each take {a} minutes to burn unevenly. How can you measure {h} minutes?",
]
_EXTRACTION_TEMPLATES = [
    "Extract every date and the event that happened on it from this text:\n\n{p}",
    "List the people and places mentioned in the following text as JSON:\n\n{p}",
    "Summarise the following text in one sentence:\n\n{p}", "Rewrite the following text in simpler words:\n\n{p}",
    "Answer using only the text below: what is the main point?\n\n{p}",
]
_PASSAGES = [
    "On 12 March 1998 the city council of Lindor approved a new bridge over the Vass river. Construction began in "
    "June 1999 under the engineer Mara Kell and ended on 3 October 2002, when the mayor, Piet Oran, opened it.",
    "The museum in Carrow reopened on 5 May after two years of repairs. Its director, Jon Abe, said the new wing "
    "would hold the collection of maps donated by the Holm family in 1911.",
    "Water boils at a lower temperature at high altitude because the air pressure is lower. Cooks in mountain towns "
    "therefore need longer times to boil pasta, and pressure cookers are popular there.",
    "In 1865 the explorer Ida Marr crossed the Tolan desert with twelve camels. She reached the oasis of Keth on 9 "
    "August and wrote that the well there was the deepest she had ever seen.",
    "The company reported revenue of 4.2 million dollars in 2021 and 5.1 million in 2022. Its chief executive, "
    "Lena Park, expects growth to slow in 2023 because of higher costs.",
]
_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "finds the largest element of a list", "checks whether a string is a palindrome",
    "flattens a nested list", "converts a binary string to an integer", "returns the word frequencies of a text",
    "transposes a matrix given as a list of lists", "computes the greatest common divisor of two integers",
    "splits a list into chunks of size n", "validates an email address with a regular expression",
    "reads a CSV file and returns the rows as dictionaries", "implements binary search on a sorted list",
    "rotates a list by k positions", "returns all permutations of a string",
]
_CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a Python function that {c}, with a docstring and two examples.",
    "Explain how to write a function that {c}, then show the code.", "Write a JavaScript function that {c}.",
]


def chat_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct single-turn instructions across the MT-Bench categories (deterministic in ``seed``)."""
    rng = random.Random(seed)
    pool: list[str] = []
    for template in _CHAT_TEMPLATES:
        for topic in _TOPICS:
            other = _TOPICS[(_TOPICS.index(topic) + 7) % len(_TOPICS)]
            pool.append(template.format(t=topic, u=other))
    for template in _MATH_TEMPLATES + _REASONING_TEMPLATES:
        for _ in range(12):
            a, b = rng.randint(2, 60), rng.randint(2, 30)
            pool.append(template.format(a=a, b=b, c=rng.randint(61, 500), d=a + b, e=a + 2 * b, h=rng.choice([15, 45]),
                                        x=rng.choice(["cats", "stones", "cars"]), y=rng.choice(["pets", "objects"])))
    for template in _EXTRACTION_TEMPLATES:
        for passage in _PASSAGES:
            pool.append(template.format(p=passage))
    for template in _CODE_TEMPLATES:
        for task in _CODE_TASKS:
            pool.append(template.format(c=task))
    pool = sorted(set(pool))
    rng.shuffle(pool)
    return pool[:num_prompts]


def stdlib_code_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """HumanEval-shaped tasks from documented top-level functions of the installed Python standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not 40 <= len(doc) <= 600:
                continue
            signature = f"def {node.name}({ast.unparse(node.args)}):"
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            found.append(f'Complete this Python function:\n\n```python\n{signature}\n'
                         f'    """{body.strip()}\n    """\n```')
    random.Random(seed).shuffle(found)
    return found[:num_prompts]


def default_training_prompts(num_chat: int = 600, num_code: int = 300, seed: int = 0) -> list[str]:
    """The default mix: chat instructions and standard-library code tasks, interleaved."""
    chat, code = chat_prompts(num_chat, seed), stdlib_code_prompts(num_code, seed)
    mixed: list[str] = []
    for i in range(max(len(chat), len(code))):
        mixed.extend(x[i] for x in (chat, code) if i < len(x))
    return mixed
