r"""Final-answer extraction, shared by the GSM8K loader, the rule-based rewards and the environments: the last
``\boxed{...}`` or ``<answer>...</answer>``, else the ``#### <answer>`` line of a GSM8K-style solution, else the
last number in the text, in a canonical form."""

from __future__ import annotations

import re

_INTEGER = r"(?:\d{1,3}(?:,\d{3})+|\d+)"  # 1,234,567 or 1234567
_NUMBER = re.compile(rf"(?:(?<![\w.)])-)?{_INTEGER}(?:\.\d+)?(?:/{_INTEGER})?")  # -1,234.5 or 3/1,000

# Every character str.isspace() accepts (what \s matches); all lie below U+3001. str.strip with these runs in
# linear time, where the regular expression [\s.]+$ is quadratic on a long run of spaces inside the text.
_WHITESPACE = "".join(chr(code) for code in range(0x3001) if chr(code).isspace())
_SIGNED_DOLLARS = re.compile(r"^-[\s$]+")  # "-$5" and "- 5" mean -5


def normalize_answer(text: str) -> str:
    """Canonical form of a final answer: thousands separators, leading '$' signs (also after a minus sign) and
    trailing periods removed, with the spaces around them. Normalising twice changes nothing more."""
    text = text.replace(",", "").lstrip(_WHITESPACE + "$").rstrip(_WHITESPACE + ".")
    return _SIGNED_DOLLARS.sub("-", text)


def extract_final_answer(text: str) -> str | None:
    r"""The final answer of a solution, or None when there is none.

    The content of the last ``\boxed{...}`` when there is one (LaTeX such as ``\frac{3}{4}``, kept as written but
    for outer spaces and '$' signs), else that of the last ``<answer>...</answer>`` (reasoning-gym's convention),
    else the rest of the line after the last ``####`` (GSM8K's convention, normalised by ``normalize_answer``),
    else the last number in the text (integer, decimal, negative or fraction such as ``3/4``, commas removed).

    >>> [extract_final_answer(text) for text in ("so x = \\boxed{\\frac{1}{2}}.", "<answer>cat</answer>",
    ...                                          "#### 1,234", "3 then 4")]
    ['\\frac{1}{2}', 'cat', '1234', '4']
    """
    boxed = last_boxed(text)
    if boxed is None:
        boxed = last_tagged(text)
    if boxed is not None:
        return boxed.strip(_WHITESPACE + "$") or None
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        answer = normalize_answer(after.splitlines()[0]) if after else ""
        return answer or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` of ``text`` (braces balanced), or None when there is none or it
    is not closed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` of ``text``, or None (found with two reverse searches: linear
    time on any text)."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end) if end >= 0 else -1
    return text[start + len(tag) + 2 : end] if start >= 0 else None
