"""Number and duration notations."""

_ROMAN = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


def to_roman(n):
  """`n` (1..3999) in Roman numerals."""
  if not 0 < n < 4000:
    raise ValueError("out of range")
  out = ""
  for value, letters in _ROMAN:
    while n >= value:
      out += letters
      n -= value
  return out


def from_roman(text):
  """The integer of a Roman numeral."""
  values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
  total = 0
  for i, ch in enumerate(text):
    v = values[ch]
    if i + 1 < len(text) and values[text[i + 1]] > v:
      total -= v
    else:
      total += v
  return total


def to_base(n, base):
  """The digits of `n` >= 0 in `base` (2..16), as text."""
  digits = "0123456789abcdef"
  if n == 0:
    return "0"
  out = ""
  while n > 0:
    out = digits[n % base] + out
    n //= base
  return out


def parse_duration(text):
  """Seconds in a duration like "1h30m", "45s", "2h5s"."""
  units = {"h": 3600, "m": 60, "s": 1}
  total, number = 0, ""
  for ch in text:
    if ch.isdigit():
      number += ch
    elif ch in units and number:
      total += int(number) * units[ch]
      number = ""
    else:
      raise ValueError(f"bad duration {text!r}")
  if number:
    raise ValueError(f"bad duration {text!r}")
  return total


def celsius_to_fahrenheit(c):
  """Degrees Celsius in Fahrenheit."""
  return c * 9 / 5 + 32
