"""List helpers."""


def chunks(xs, size):
  """`xs` in consecutive pieces of `size` (the last may be shorter)."""
  if size < 1:
    raise ValueError("size must be >= 1")
  return [xs[i:i + size] for i in range(0, len(xs), size)]


def flatten(xss):
  """One list of the items of a list of lists."""
  out = []
  for xs in xss:
    out.extend(xs)
  return out


def dedupe(xs):
  """`xs` without repeats, first occurrences kept in order."""
  seen, out = set(), []
  for x in xs:
    if x not in seen:
      seen.add(x)
      out.append(x)
  return out


def rotate(xs, k):
  """`xs` rotated left by `k` places."""
  if not xs:
    return []
  k %= len(xs)
  return xs[k:] + xs[:k]


def binary_search(xs, target):
  """The index of `target` in sorted `xs`, or -1."""
  lo, hi = 0, len(xs) - 1
  while lo <= hi:
    mid = (lo + hi) // 2
    if xs[mid] == target:
      return mid
    if xs[mid] < target:
      lo = mid + 1
    else:
      hi = mid - 1
  return -1


def merge_sorted(a, b):
  """The sorted merge of two sorted lists."""
  i = j = 0
  out = []
  while i < len(a) and j < len(b):
    if a[i] <= b[j]:
      out.append(a[i])
      i += 1
    else:
      out.append(b[j])
      j += 1
  return out + a[i:] + b[j:]


def windows(xs, n):
  """Every run of `n` consecutive items, as tuples."""
  return [tuple(xs[i:i + n]) for i in range(len(xs) - n + 1)]
