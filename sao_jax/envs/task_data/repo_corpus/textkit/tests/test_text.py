import unittest

from textkit.text import caesar, count_words, is_palindrome, slugify, truncate, wrap


class TestText(unittest.TestCase):

  def test_slugify(self):
    self.assertEqual(slugify("Hello, World!"), "hello-world")
    self.assertEqual(slugify("  a  b "), "a-b")
    self.assertEqual(slugify("abc"), "abc")
    self.assertEqual(slugify(""), "")

  def test_truncate(self):
    self.assertEqual(truncate("hello", 10), "hello")
    self.assertEqual(truncate("hello", 5), "hello")
    self.assertEqual(truncate("hello world", 8), "hello...")
    self.assertEqual(truncate("hello", 2), "..")

  def test_is_palindrome(self):
    self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))
    self.assertTrue(is_palindrome(""))
    self.assertTrue(is_palindrome("abba"))
    self.assertFalse(is_palindrome("abca"))
    self.assertFalse(is_palindrome("ab"))

  def test_count_words(self):
    self.assertEqual(count_words("the cat The dog"), {"the": 2, "cat": 1, "dog": 1})
    self.assertEqual(count_words(""), {})

  def test_wrap(self):
    self.assertEqual(wrap("a bb ccc dd", 5), ["a bb", "ccc", "dd"])
    self.assertEqual(wrap("aaa bb", 6), ["aaa bb"])
    self.assertEqual(wrap("", 4), [])

  def test_caesar(self):
    self.assertEqual(caesar("abz", 1), "bca")
    self.assertEqual(caesar("Hello, World", 3), "Khoor, Zruog")
    self.assertEqual(caesar("bca", -1), "abz")


if __name__ == "__main__":
  unittest.main()
