import unittest

from numkit.stats import clamp, mean, median, percentile, running_sum, variance


class TestStats(unittest.TestCase):

  def test_mean(self):
    self.assertEqual(mean([1, 2, 3, 4]), 2.5)
    self.assertEqual(mean([5]), 5)
    with self.assertRaises(ValueError):
      mean([])

  def test_median_odd(self):
    self.assertEqual(median([3, 1, 2]), 2)
    self.assertEqual(median([7]), 7)

  def test_median_even(self):
    self.assertEqual(median([4, 1, 3, 2]), 2.5)
    self.assertEqual(median([10, 20]), 15)

  def test_median_empty(self):
    with self.assertRaises(ValueError):
      median([])

  def test_variance(self):
    self.assertEqual(variance([2, 4, 4, 4, 5, 5, 7, 9]), 4)
    self.assertEqual(variance([3, 3]), 0)

  def test_clamp(self):
    self.assertEqual(clamp(5, 0, 10), 5)
    self.assertEqual(clamp(-3, 0, 10), 0)
    self.assertEqual(clamp(12, 0, 10), 10)
    self.assertEqual(clamp(0, 0, 10), 0)
    self.assertEqual(clamp(10, 0, 10), 10)
    with self.assertRaises(ValueError):
      clamp(1, 5, 2)

  def test_running_sum(self):
    self.assertEqual(running_sum([1, 2, 3]), [1, 3, 6])
    self.assertEqual(running_sum([]), [])

  def test_percentile(self):
    self.assertEqual(percentile([1, 2, 3, 4, 5], 50), 3)
    self.assertEqual(percentile([1, 2, 3, 4, 5], 0), 1)
    self.assertEqual(percentile([1, 2, 3, 4, 5], 100), 5)
    self.assertEqual(percentile([10, 20], 25), 12.5)
    with self.assertRaises(ValueError):
      percentile([1], 101)


if __name__ == "__main__":
  unittest.main()
