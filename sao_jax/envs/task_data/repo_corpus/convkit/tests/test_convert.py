import unittest

from convkit.convert import celsius_to_fahrenheit, from_roman, parse_duration, to_base, to_roman


class TestConvert(unittest.TestCase):

  def test_to_roman(self):
    self.assertEqual(to_roman(1), "I")
    self.assertEqual(to_roman(4), "IV")
    self.assertEqual(to_roman(9), "IX")
    self.assertEqual(to_roman(14), "XIV")
    self.assertEqual(to_roman(1994), "MCMXCIV")
    self.assertEqual(to_roman(3999), "MMMCMXCIX")
    with self.assertRaises(ValueError):
      to_roman(0)
    with self.assertRaises(ValueError):
      to_roman(4000)

  def test_from_roman(self):
    self.assertEqual(from_roman("III"), 3)
    self.assertEqual(from_roman("IV"), 4)
    self.assertEqual(from_roman("MCMXCIV"), 1994)
    self.assertEqual(from_roman("XL"), 40)

  def test_to_base(self):
    self.assertEqual(to_base(0, 2), "0")
    self.assertEqual(to_base(10, 2), "1010")
    self.assertEqual(to_base(255, 16), "ff")
    self.assertEqual(to_base(7, 8), "7")

  def test_parse_duration(self):
    self.assertEqual(parse_duration("1h30m"), 5400)
    self.assertEqual(parse_duration("45s"), 45)
    self.assertEqual(parse_duration("2h5s"), 7205)
    self.assertEqual(parse_duration(""), 0)
    for bad in ("5", "h", "1x", "3m2"):
      with self.assertRaises(ValueError):
        parse_duration(bad)

  def test_celsius_to_fahrenheit(self):
    self.assertEqual(celsius_to_fahrenheit(0), 32)
    self.assertEqual(celsius_to_fahrenheit(100), 212)
    self.assertEqual(celsius_to_fahrenheit(-40), -40)


if __name__ == "__main__":
  unittest.main()
