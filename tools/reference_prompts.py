"""The prompts of the model reference fixture: plain text and ChatML, a few to ~600 tokens."""

from __future__ import annotations

__all__ = ["PROMPTS", "chatml"]

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(turns: list[tuple[str, str]], system: str = DEFAULT_SYSTEM) -> str:
    """The GGUF's chat template rendered with add_generation_prompt=True."""
    out = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    out += [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns]
    out.append("<|im_start|>assistant\n")
    return "".join(out)


_CODE = """import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)


class Scheduler:
    def __init__(self) -> None:
        self._queue: list[Job] = []

    def submit(self, name: str, priority: int) -> None:
        heapq.heappush(self._queue, Job(priority, name))

    def next(self) -> str | None:
        if not self._queue:
            return None
        return heapq.heappop(self._queue).name


def main() -> None:
    s = Scheduler()
    s.submit("backup", 3)
    s.submit("deploy", 1)
    s.submit("report", 2)
    while (job := s.next()) is not None:
"""

_HISTORY = (
    "The printing press, developed by Johannes Gutenberg around 1440 in Mainz, changed the way "
    "knowledge moved through Europe. Before it, books were copied by hand, usually by monks working "
    "in scriptoria, and a single Bible could take a scribe more than a year to finish. Gutenberg "
    "combined several existing ideas: movable metal type cast from a durable alloy of lead, tin and "
    "antimony; an oil-based ink that clung to metal better than the water-based inks of the time; and "
    "a screw press adapted from the ones used to make wine and olive oil. The result was a machine "
    "that could produce hundreds of identical pages a day.\n\n"
    "Within fifty years, presses were operating in more than two hundred European cities, and "
    "historians estimate that some twenty million volumes had been printed by 1500. Prices fell, "
    "literacy rose, and ideas that once circulated among a few scholars could reach thousands of "
    "readers. The Protestant Reformation is often cited as the first mass movement to take advantage "
    "of print: Martin Luther's pamphlets were reprinted across the German states faster than the "
    "authorities could suppress them. Scientists benefited as well, because printed tables, diagrams "
    "and observations could be checked and corrected by colleagues far away, which made errors easier "
    "to find and results easier to build upon.\n\n"
    "The press also standardised languages. Printers had to choose one spelling for each word, and the "
    "choices made in busy printing centres such as Venice, Paris and London slowly became the norm. "
    "Grammar books and dictionaries followed. At the same time, the economics of printing favoured "
    "works that would sell, so vernacular romances, almanacs and practical manuals became as common as "
    "Latin theology. Censorship, copyright and the idea of an author's rights all emerged in response "
    "to the new technology, as governments and writers tried to control what was printed and who "
    "profited from it.\n\n"
    "Some historians argue that the changes were slower and less dramatic than the popular story "
    "suggests. Manuscripts continued to be produced for decades, many early printed books imitated "
    "the look of handwritten ones, and literacy remained low in rural areas for centuries. Others "
    "point out that the press did not act alone: paper mills, trade routes, universities and the "
    "growing merchant class all shaped how printed material was made and used. Still, few doubt that "
    "the ability to copy text cheaply and exactly was one of the turning points of European history.\n\n"
    "Similar debates surround later inventions. The telegraph, the telephone, radio, television and "
    "the internet were each greeted as revolutions, and each was later described by scholars as part "
    "of a longer story of gradual change. What they share with the press is that they lowered the cost "
    "of sending information to many people at once, and in doing so they changed who could speak, who "
    "could listen, and what counted as common knowledge."
)

_NUMBERS = (
    "Quarterly report. Revenue: Q1 1,204,500; Q2 1,387,250; Q3 1,512,900; Q4 1,688,125. "
    "Costs: Q1 980,000; Q2 1,010,400; Q3 1,105,750; Q4 1,201,300. "
    "The profit in Q1 was 224,500, in Q2 376,850, in Q3 407,150, and in Q4"
)

_STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker named Elias. Every morning he opened his shop at seven, wound every clock on the "
    "walls, and listened to them tick together like a choir. One winter evening a girl knocked on "
    'his door carrying a broken pocket watch wrapped in a red scarf. "It was my grandfather\'s," she '
    'said, "and it stopped the night he left." Elias turned the watch over in his hands, opened the '
    "back with a tiny brass key, and saw that"
)

_TRIP = [
    ("user", "I'm planning a trip to Japan in April."),
    (
        "assistant",
        "That's a great time to visit: the cherry blossoms are usually in bloom. "
        "Which cities are you thinking about?",
    ),
    ("user", "Tokyo and Kyoto. What should I see in Kyoto?"),
]
_CODE_QUESTION = (
    f"What does this program print?\n\n```python\n{_CODE}        print(job)\n\n\nmain()\n```"
)
_SUMMARY_REQUEST = f"Summarise the following text in two sentences.\n\n{_HISTORY}"
_TERSE = "You are a concise assistant. Answer in a numbered list."

# (name, kind, text): kind is "plain" (raw text) or "chat" (rendered ChatML).
PROMPTS: list[tuple[str, str, str]] = [
    ("one_word", "plain", "Hello"),
    ("capital", "plain", "The capital of France is"),
    ("chat_hi", "chat", chatml([("user", "Hi")])),
    ("chat_math", "chat", chatml([("user", "What is 17 * 23? Explain step by step.")])),
    ("numbers", "plain", _NUMBERS),
    ("code", "plain", _CODE),
    ("chat_code", "chat", chatml([("user", _CODE_QUESTION)])),
    ("story", "plain", _STORY),
    ("chat_multi", "chat", chatml(_TRIP)),
    ("chinese", "plain", "人工智能是计算机科学的一个分支，它试图理解智能的实质，并"),
    ("chat_system", "chat", chatml([("user", "Give me three tips for better sleep.")], _TERSE)),
    ("history_long", "plain", _HISTORY),
    ("chat_summary_long", "chat", chatml([("user", _SUMMARY_REQUEST)])),
]
