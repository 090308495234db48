"""Summary statistics of a sequence of numbers."""


def mean(xs):
  """The arithmetic mean; ValueError for an empty sequence."""
  if not xs:
    raise ValueError("mean of an empty sequence")
  return sum(xs) / len(xs)


def median(xs):
  """The middle value, or the mean of the two middle values."""
  if not xs:
    raise ValueError("median of an empty sequence")
  s = sorted(xs)
  mid = len(s) // 2
  if len(s) % 2 == 1:
    return s[mid]
  return (s[mid - 1] + s[mid]) / 2


def variance(xs):
  """The population variance."""
  m = mean(xs)
  return sum((x - m) ** 2 for x in xs) / len(xs)


def clamp(x, low, high):
  """`x` limited to [low, high]."""
  if low > high:
    raise ValueError("low > high")
  if x < low:
    return low
  if x > high:
    return high
  return x


def running_sum(xs):
  """The prefix sums: [x0, x0 + x1, ...]."""
  total, out = 0, []
  for x in xs:
    total += x
    out.append(total)
  return out


def percentile(xs, p):
  """The p-th percentile (0 <= p <= 100) by linear interpolation."""
  if not 0 <= p <= 100:
    raise ValueError("p must be in [0, 100]")
  s = sorted(xs)
  k = (len(s) - 1) * p / 100
  lo = int(k)
  hi = min(lo + 1, len(s) - 1)
  return s[lo] + (s[hi] - s[lo]) * (k - lo)
