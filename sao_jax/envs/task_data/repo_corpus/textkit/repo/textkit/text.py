"""String helpers."""


def slugify(text):
  """Lower-case words joined by single dashes; other characters dropped."""
  words, word = [], ""
  for ch in text.lower():
    if ch.isalnum():
      word += ch
    elif word:
      words.append(word)
      word = ""
  if word:
    words.append(word)
  return "-".join(words)


def truncate(text, width, ellipsis="..."):
  """`text` cut to at most `width` characters, ending with `ellipsis` if cut."""
  if len(text) <= width:
    return text
  if width <= len(ellipsis):
    return ellipsis[:width]
  return text[:width - len(ellipsis)] + ellipsis


def is_palindrome(text):
  """Whether the letters and digits of `text` read the same both ways."""
  chars = [c.lower() for c in text if c.isalnum()]
  i, j = 0, len(chars) - 1
  while i < j:
    if chars[i] != chars[j]:
      return False
    i += 1
    j -= 1
  return True


def count_words(text):
  """A dict of lower-cased word -> count, words split on whitespace."""
  counts = {}
  for word in text.lower().split():
    counts[word] = counts.get(word, 0) + 1
  return counts


def wrap(text, width):
  """Words packed greedily into lines of at most `width` characters."""
  lines, line = [], ""
  for word in text.split():
    if not line:
      line = word
    elif len(line) + 1 + len(word) <= width:
      line += " " + word
    else:
      lines.append(line)
      line = word
  if line:
    lines.append(line)
  return lines


def caesar(text, shift):
  """Letters shifted by `shift` places in the alphabet, case kept."""
  out = []
  for ch in text:
    if "a" <= ch <= "z":
      out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
    elif "A" <= ch <= "Z":
      out.append(chr((ord(ch) - ord("A") + shift) % 26 + ord("A")))
    else:
      out.append(ch)
  return "".join(out)
