"""The `chat` source of the training prompt set: everyday assistant requests, written here.

Contract: `chat_prompts()` -> [(template, subject, user text)] in a fixed order, deterministic, no
network. The families are the kinds of request a chat benchmark asks (writing, role-play,
extraction, STEM and humanities explanations, advice, argument) over subjects listed here; none
copies a benchmark prompt (`training.prompts` checks every text against the benchmark anyway).
Extraction items are synthetic records drawn with `sources.hash64(CHAT_SEED, index, field)`, so
they are the same on every platform. The other sources lean on code, documentation and science;
this one covers what a chat user writes.
"""

from __future__ import annotations

import itertools

from specdecode.training.sources import _groups, hash64

CHAT_SEED = 4242
NUM_EXTRACTION = 240


def _lines(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.strip().splitlines() if t.strip())


PLACES = _lines("""
a fishing village on a rocky coast
a night market in a busy city
a mountain hut above the tree line
a desert town at noon
an old public library
a train station at dawn
a rainforest after a storm
a small bakery before opening time
a frozen lake in midwinter
a harbour full of sailboats
a vineyard at harvest time
a crowded football stadium
a quiet monastery garden
a lighthouse during a gale
a street festival in summer
an abandoned amusement park
a riverside town in autumn
a hospital waiting room at night
a rooftop garden in a big city
a farmers' market on a Saturday morning
a jazz club after midnight
a snowbound cabin
a coral reef seen by a diver
a village wedding
a science museum on a school day
a ferry crossing on a foggy morning
a university campus during exams
a flower field in spring
a subway car at rush hour
a campsite under the stars
""")
_PLACE_TEMPLATES = {
    "travel_blog": "Write a travel blog post about spending a few days in {s}: what to see, what to eat, "
    "and one practical tip.",
    "senses": "Write a descriptive paragraph about {s} that appeals to all five senses.",
    "story": "Write a short story (under 400 words) set in {s}, with a surprising ending.",
    "poem": "Write a poem about {s}.",
    "postcard": "Write a postcard message to a friend from {s}.",
}
SITUATIONS = _lines("""
asking your manager for feedback on a report you wrote
declining a meeting invitation politely
asking a landlord to repair a broken heater
thanking a colleague who helped you meet a deadline
inviting your team to a farewell lunch for a coworker
following up on a job application you sent two weeks ago
asking a professor for a recommendation letter
apologising to a customer for a late delivery
proposing a new weekly meeting schedule to your team
requesting a refund for a faulty product
introducing yourself to a new client
asking a neighbour to keep the noise down in the evening
reminding a friend about money they borrowed
announcing a price increase to long-time customers
asking for a day off to attend a family event
welcoming a new employee to the team
responding to a complaint about poor service
asking a conference to let you give a talk
cancelling a subscription and explaining why
congratulating a former colleague on a promotion
""")
_SITUATION_TEMPLATES = {
    "email": "Draft a polite, concise email {s}.",
    "letter": "Write a formal letter {s}.",
    "message": "Write a short, friendly chat message {s}.",
}
ROLES = _lines("""
a ship's captain in the nineteenth century
a medieval blacksmith
a museum guide in an art gallery
a personal fitness trainer
a detective in a 1920s city
a head chef of a busy restaurant
a park ranger in a national park
a startup founder pitching to investors
a kindergarten teacher
a veterinarian
an astronaut on a space station
a librarian
a barista who loves coffee
a mountain guide
a history professor
a marriage counsellor
a car mechanic
a nutritionist
a theatre director
a software team lead
""")
_ROLE_QUESTIONS = {
    "day": "Describe a typical day in your work.",
    "advice": "What advice would you give someone who wants to do what you do?",
    "challenge": "Tell me about the hardest problem you have faced and how you solved it.",
    "customer": "A newcomer asks you to explain the basics of your job. Answer them.",
    "myth": "What do people most often misunderstand about your work?",
}
HUMANITIES = _groups("""
the Renaissance; the Industrial Revolution; the French Revolution; the fall of Rome; the Silk Road; printing
inflation; supply and demand; unemployment; international trade; central banks; economic recessions
stoicism; utilitarianism; existentialism; the social contract; free will; the ethics of AI
democracy; the separation of powers; human rights; freedom of speech; federalism; the rule of law
impressionist painting; the history of jazz; the modern novel; Greek tragedy; film noir; modern architecture
habits; motivation; stress; memory; procrastination; decision making
urbanisation; globalisation; social media; remote work; public transport; the four-day work week
marketing; leadership; negotiation; customer service; teamwork; starting a small business
personal budgeting; saving for retirement; credit scores; compound interest; index funds; insurance
healthy sleep; balanced diets; regular exercise; mindfulness; hydration; posture
learning a language; studying for exams; public speaking; time management; critical thinking; note taking
the history of money; the invention of writing; the age of exploration; the space race; the Cold War; the web
""")
_HUMANITIES_TEMPLATES = {
    "overview": "Give me an overview of {s}: the main ideas and why they matter today.",
    "beginner": "I know nothing about {s}. Explain it to me in plain language.",
    "why": "Why does {s} matter? Explain with two real-world examples.",
    "faq": "Write five frequently asked questions about {s}, with short answers.",
    "essay": "Write a short essay (about 300 words) on {s}.",
    "debate": "What are the main arguments people make for and against {s}?",
    "teach": "How would you explain {s} to a curious twelve-year-old?",
    "tips": "Give me practical tips related to {s}, as a numbered list.",
}
_HUMANITIES_COMPARE = "Compare {a} and {b}. What do they have in common, and how do they differ?"
ADVICE = _lines("""
moving to a new city where I know nobody
preparing for my first job interview
training for a first half marathon
starting to cook at home instead of ordering food
keeping houseplants alive
planning a two-week trip on a small budget
getting along with a difficult coworker
reading more books this year
organising a birthday party for a ten-year-old
switching careers at forty
learning to play the guitar as an adult
reducing the time I spend on my phone
choosing my first car
preparing a garden for winter
adopting a dog from a shelter
""")
_ADVICE_TEMPLATES = {
    "steps": "I am {s}. What should I do? Give practical, step-by-step advice.",
    "mistakes": "What mistakes do people usually make when {s}, and how can I avoid them?",
}
CLAIMS = _lines("""
schools should start later in the morning
cities should ban cars from their centres
homework should be optional
everyone should learn to code
museums should be free to visit
remote work is better than office work
public libraries matter more than ever
people should take a year off before university
voting should be compulsory
space exploration is worth its cost
""")
_CLAIM_TEMPLATES = {
    "persuade": "Write a persuasive essay arguing that {s}.",
    "both_sides": "Give the strongest arguments for and against the claim that {s}, then your conclusion.",
    "speech": "Write a one-minute speech for a school debate claiming that {s}.",
}
# Extraction: synthetic short texts (people, orders, reviews) and a request to structure them.
_FIRST = ("Aiko", "Ben", "Chiara", "Diego", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena")
_CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Perth", "Tallinn", "Seville", "Hanoi")
_JOBS = ("nurse", "architect", "teacher", "electrician", "pilot", "accountant", "baker", "journalist")
_PRODUCTS = ("a blender", "running shoes", "a desk lamp", "a backpack", "headphones", "a kettle", "a tent")
_ISSUES = ("arrived late", "stopped working after a week", "was smaller than expected", "works perfectly")


def _pick(index: int, field: str, options: tuple):
    return options[hash64(CHAT_SEED, index, field) % len(options)]


def _extraction(index: int) -> tuple[str, str]:
    kind = ("people", "reviews")[index % 2]
    if kind == "people":
        lines = [
            f"{_pick(index, f'n{j}', _FIRST)} is a {_pick(index, f'j{j}', _JOBS)} who moved to "
            f"{_pick(index, f'c{j}', _CITIES)} in {1990 + int(_pick(index, f'y{j}', tuple(range(34))))}."
            for j in range(3)
        ]
        ask = "Extract each person's name, job, city and the year they moved as a JSON list."
    else:
        lines = [
            f"Review {j + 1}: I bought {_pick(index, f'p{j}', _PRODUCTS)} for "
            f"{_pick(index, f'd{j}', tuple(range(15, 200)))} dollars and it "
            f"{_pick(index, f'i{j}', _ISSUES)}; I rate it {_pick(index, f's{j}', (1, 2, 3, 4, 5))} out of 5."
            for j in range(3)
        ]
        ask = "For each review, extract the product, the price, the rating and the main point as a table."
    return kind, ask + "\n\n" + "\n".join(lines)


def chat_prompts() -> list[tuple[str, str, str]]:
    """-> [(template, subject, user text)] of every chat family, in a fixed order."""
    out = []
    for family, subjects in (
        (_PLACE_TEMPLATES, PLACES),
        (_SITUATION_TEMPLATES, SITUATIONS),
        (_ADVICE_TEMPLATES, ADVICE),
        (_CLAIM_TEMPLATES, CLAIMS),
    ):
        out += [(name, s, t.format(s=s)) for s in subjects for name, t in family.items()]
    out += [
        (f"role_{q}", r, f"Pretend you are {r}. {text}") for r in ROLES for q, text in _ROLE_QUESTIONS.items()
    ]
    for group in HUMANITIES:
        out += [(name, s, t.format(s=s)) for s in group for name, t in _HUMANITIES_TEMPLATES.items()]
        out += [
            ("compare", f"{a} | {b}", _HUMANITIES_COMPARE.format(a=a, b=b))
            for a, b in itertools.combinations(group, 2)
        ]
    for i in range(NUM_EXTRACTION):
        kind, text = _extraction(i)
        out.append((f"extract_{kind}", str(i), text))
    return out
