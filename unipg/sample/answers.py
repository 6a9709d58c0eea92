"""Final-answer extraction, shared by the GSM8K loader, the rule-based rewards and the environments: the
``#### <answer>`` line of a GSM8K-style solution, else the last number in the text, in a canonical form."""

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
    """The final answer of a GSM8K-style solution, or None when there is none.

    The rest of the line after the last ``####`` when present (normalised by ``normalize_answer``), else the
    last number in the text (integer, decimal, negative or fraction such as ``3/4``, with commas removed).
    """
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        answer = normalize_answer(after.splitlines()[0]) if after else ""
        return answer or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None
