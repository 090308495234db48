import unittest

from seqkit.seq import binary_search, chunks, dedupe, flatten, merge_sorted, rotate, windows


class TestSeq(unittest.TestCase):

  def test_chunks(self):
    self.assertEqual(chunks([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])
    self.assertEqual(chunks([1, 2], 2), [[1, 2]])
    self.assertEqual(chunks([], 3), [])
    with self.assertRaises(ValueError):
      chunks([1], 0)

  def test_flatten(self):
    self.assertEqual(flatten([[1, 2], [], [3]]), [1, 2, 3])

  def test_dedupe(self):
    self.assertEqual(dedupe([3, 1, 3, 2, 1]), [3, 1, 2])
    self.assertEqual(dedupe([]), [])

  def test_rotate(self):
    self.assertEqual(rotate([1, 2, 3, 4], 1), [2, 3, 4, 1])
    self.assertEqual(rotate([1, 2, 3], 4), [2, 3, 1])
    self.assertEqual(rotate([1, 2, 3], 0), [1, 2, 3])
    self.assertEqual(rotate([], 2), [])

  def test_binary_search(self):
    xs = [1, 3, 5, 7, 9, 11]
    for i, x in enumerate(xs):
      self.assertEqual(binary_search(xs, x), i)
    self.assertEqual(binary_search(xs, 4), -1)
    self.assertEqual(binary_search(xs, 12), -1)
    self.assertEqual(binary_search([], 1), -1)

  def test_merge_sorted(self):
    self.assertEqual(merge_sorted([1, 4, 6], [2, 3, 7, 8]), [1, 2, 3, 4, 6, 7, 8])
    self.assertEqual(merge_sorted([], [1]), [1])
    self.assertEqual(merge_sorted([2, 2], [2]), [2, 2, 2])

  def test_windows(self):
    self.assertEqual(windows([1, 2, 3, 4], 2), [(1, 2), (2, 3), (3, 4)])
    self.assertEqual(windows([1, 2], 2), [(1, 2)])
    self.assertEqual(windows([1], 2), [])


if __name__ == "__main__":
  unittest.main()
