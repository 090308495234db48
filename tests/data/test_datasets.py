"""Dataset rows: the three file types, every rejection with its place, splits."""

import gzip
import json

import pytest

from sao_jax.data import datasets
from sao_jax.data.datasets import DatasetError, Row, load_rows, split_rows

GOOD = [
  {
    "prompt": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is 2+3?"},
    ],
    "reward_model": {"ground_truth": "5", "style": "rule"},
    "data_source": "toy",
    "extra_info": {"index": 0},
  },
  {"prompt": "What is 10/4?", "answer": 2.5},
  {
    "prompt": "Add 1 and 2 with the tool.",
    "answer": 3,
    "tools": [{"type": "function", "function": {"name": "python", "parameters": {}}}],
    "completion": [
      {
        "role": "assistant",
        "content": None,
        "tool_calls": [
          {"type": "function", "function": {"name": "python", "arguments": '{"code": "1+2"}'}}
        ],
      },
      {"role": "tool", "content": "3"},
      {"role": "assistant", "content": "\\boxed{3}"},
    ],
  },
  {"prompt": "Say 7.", "answer": "7", "extra_info": {"completion": "\\boxed{7}"}},
]


def write_jsonl(path, lines, opener=open):
  with opener(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
  return str(path)


def check_good(rows, where, extra_nones=False):
  assert [r.where for r in rows] == where
  a, b, c, d = rows
  assert a.messages == tuple(GOOD[0]["prompt"])
  # Parquet's unified struct column gives every row every key (None if absent);
  # extra_info is the user's own data, kept as read.
  none = {"completion": None} if extra_nones else {}
  assert (a.ground_truth, a.data_source, a.extra_info) == ("5", "toy", {"index": 0, **none})
  assert (a.tools, a.completion) == ((), ())
  assert b.messages == ({"role": "user", "content": "What is 10/4?"},)
  assert (b.ground_truth, b.data_source) == ("2.5", "")
  assert b.extra_info == {}  # no extra_info at all: a null struct
  assert c.ground_truth == "3" and c.tools == tuple(GOOD[2]["tools"])
  assert c.completion == (
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [{"name": "python", "arguments": {"code": "1+2"}}],
    },
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "\\boxed{3}"},
  )
  assert d.completion == ({"role": "assistant", "content": "\\boxed{7}"},)


def test_jsonl(tmp_path):
  path = write_jsonl(
    tmp_path / "train.jsonl", [GOOD[0], b"\n", GOOD[1], b"   \r\n", GOOD[2], GOOD[3]]
  )
  rows, rejected = load_rows(path)
  assert rejected == []  # blank lines are skipped, not rejected
  check_good(rows, [f"{path}:1", f"{path}:3", f"{path}:5", f"{path}:6"])


def test_jsonl_gz(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl.gz", GOOD, gzip.open)
  rows, rejected = load_rows(path)
  assert rejected == []
  check_good(rows, [f"{path}:{i}" for i in (1, 2, 3, 4)])


def test_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  # Tools as a JSON string, as parquet writers store heterogeneous schemas;
  # the nested prompt and completion are struct columns (the unified struct
  # gives every message every key, None where a row lacks it).
  keys = (
    "prompt",
    "reward_model",
    "answer",
    "data_source",
    "extra_info",
    "tools",
    "completion",
  )  # from_pylist takes its columns from the first row
  table = pa.Table.from_pylist(
    [
      {
        **{k: g.get(k) for k in keys},
        "tools": json.dumps(g["tools"]) if "tools" in g else None,
        "answer": str(g["answer"]) if "answer" in g else None,
        "prompt": g["prompt"]
        if isinstance(g["prompt"], list)
        else [{"role": "user", "content": g["prompt"]}],
      }
      for g in GOOD
    ]
  )
  path = str(tmp_path / "train.parquet")
  pq.write_table(table, path)
  rows, rejected = load_rows(path)
  assert rejected == []
  check_good(rows, [f"{path}:row {i}" for i in range(4)], extra_nones=True)


def test_parquet_bad_row_says_its_row(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  path = str(tmp_path / "t.parquet")
  pq.write_table(
    pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]), path
  )
  rows, rejected = load_rows(path)
  assert len(rows) == 1
  assert rejected == [(f"{path}:row 1", "no ground truth (reward_model.ground_truth or answer)")]


BAD = [
  (b"[1, 2]\n", "not a JSON object"),
  (
    b'{"prompt": "x",\n',
    "bad JSON: Expecting property name enclosed in double quotes at column 16",
  ),
  ({"answer": "1"}, "prompt missing"),
  ({"prompt": 5, "answer": "1"}, "prompt must be a string or a list of messages"),
  ({"prompt": [], "answer": "1"}, "prompt is empty"),
  ({"prompt": ["hi"], "answer": "1"}, "message 0: must be an object"),
  (
    {"prompt": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "answer": "1"},
    "message 1: role must be one of system/user/assistant",
  ),
  (
    {"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "answer": "1"},
    "message 0: content must be a string",
  ),
  ({"prompt": "x"}, "no ground truth (reward_model.ground_truth or answer)"),
  (
    {"prompt": "x", "reward_model": {"style": "rule"}},
    "no ground truth (reward_model.ground_truth or answer)",
  ),
  ({"prompt": "x", "reward_model": "5"}, "reward_model must be an object"),
  ({"prompt": "x", "answer": True}, "ground truth must be a string or a number"),
  ({"prompt": "x", "answer": [1, 2]}, "ground truth must be a string or a number"),
  ({"prompt": "x", "answer": "  "}, "ground truth is empty"),
  (b'{"prompt": "x", "answer": NaN}\n', "ground truth must be a finite number"),
  ({"prompt": "x", "answer": "1", "data_source": 3}, "data_source must be a string"),
  ({"prompt": "x", "answer": "1", "extra_info": [1]}, "extra_info must be an object"),
  (
    {"prompt": "x", "answer": "1", "tools": {"name": "f"}},
    "tools must be a list of function schemas",
  ),
  (
    {"prompt": "x", "answer": "1", "tools": [{"type": "function", "function": {}}]},
    "tools must be a list of function schemas",
  ),
  ({"prompt": "x", "answer": "1", "tools": "[{"}, "tools: bad JSON: "),
  (
    {"prompt": "x", "answer": "1", "completion": 7},
    "completion must be a string or a list of messages",
  ),
  (
    {"prompt": "x", "answer": "1", "completion": [{"role": "user", "content": "a"}]},
    "completion message 0: role must be one of assistant/tool",
  ),
  (
    {"prompt": "x", "answer": "1", "completion": [{"role": "assistant", "content": 3}]},
    "completion message 0: content must be a string",
  ),
  (
    {"prompt": "x", "answer": "1", "completion": [{"role": "tool", "content": "3"}]},
    "completion must start with an assistant message",
  ),
  (
    {
      "prompt": "x",
      "answer": "1",
      "completion": [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[1]"}]}
      ],
    },
    "completion message 0: tool_calls must be a list of {name, arguments}",
  ),
  (
    {
      "prompt": "x",
      "answer": "1",
      "completion": [{"role": "assistant", "content": "", "tool_calls": "f()"}],
    },
    "completion message 0: tool_calls must be a list of {name, arguments}",
  ),
  (
    {
      "prompt": "x",
      "answer": "1",
      "completion": [{"role": "assistant", "content": "a", "reasoning_content": 1}],
    },
    "completion message 0: reasoning_content must be a string",
  ),
  (
    {"prompt": "x", "answer": "1", "extra_info": {"completion": 7}},
    "completion must be a string or a list of messages",
  ),
  (b'{"prompt": "caf\xe9", "answer": "1"}\n', "not UTF-8 (byte 15)"),
]


def test_every_rejection_with_its_line(tmp_path):
  lines = [GOOD[1]]
  for line, _ in BAD:
    lines += [line, b"\n"]  # blank lines between: numbering counts them
  path = write_jsonl(tmp_path / "mixed.jsonl", lines)
  rows, rejected = load_rows(path)
  assert [r.where for r in rows] == [f"{path}:1"]
  assert len(rejected) == len(BAD)
  for (where, reason), (i, (_, expected)) in zip(rejected, enumerate(BAD)):
    assert where == f"{path}:{2 + 2 * i}"
    assert reason.startswith(expected), (where, reason, expected)


def test_a_huge_row_is_rejected_and_the_rest_read(tmp_path):
  big = {"prompt": "x" * 2000, "answer": "1"}
  path = write_jsonl(tmp_path / "big.jsonl", [GOOD[1], big, GOOD[3]])
  rows, rejected = load_rows(path, max_row_bytes=1000)
  assert [r.where for r in rows] == [f"{path}:1", f"{path}:3"]
  assert rejected == [(f"{path}:2", "row is over max_row_bytes (2029 > 1000 bytes)")]
  # At the cap exactly it is read.
  size = len(json.dumps(big))
  rows, rejected = load_rows(path, max_row_bytes=size)
  assert len(rows) == 3 and rejected == []
  rows, rejected = load_rows(path, max_row_bytes=size - 1)
  assert len(rows) == 2 and rejected[0][0] == f"{path}:2"


def test_default_row_cap_is_a_megabyte(tmp_path):
  path = write_jsonl(tmp_path / "big.jsonl", [GOOD[1], {"prompt": "x" * (1 << 20), "answer": "1"}])
  rows, rejected = load_rows(path)
  assert len(rows) == 1 and rejected[0][0] == f"{path}:2"


def test_strict_raises_at_the_first_bad_row(tmp_path):
  path = write_jsonl(tmp_path / "s.jsonl", [GOOD[1], {"prompt": "x"}, [1]])
  with pytest.raises(DatasetError) as e:
    load_rows(path, strict=True)
  assert str(e.value) == (f"{path}:2: no ground truth (reward_model.ground_truth or answer)")
  assert len(load_rows(path)[1]) == 2


def test_unusable_files(tmp_path):
  bad = write_jsonl(tmp_path / "bad.jsonl", [[1], {"prompt": "x"}])
  with pytest.raises(
    DatasetError,
    match=r"no valid rows \(2 rejected; first: .*bad.jsonl:1: "
    r"not a JSON object\)",
  ):
    load_rows(bad)
  with pytest.raises(DatasetError, match="no valid rows"):
    load_rows(write_jsonl(tmp_path / "empty.jsonl", [b"\n"]))
  with pytest.raises(DatasetError, match="unknown file type"):
    load_rows(write_jsonl(tmp_path / "rows.json", GOOD))
  with pytest.raises(DatasetError, match="cannot read"):
    load_rows(tmp_path / "missing.jsonl")
  (tmp_path / "corrupt.jsonl.gz").write_bytes(b"not gzip at all")
  with pytest.raises(DatasetError, match="cannot read"):
    load_rows(tmp_path / "corrupt.jsonl.gz")
  (tmp_path / "corrupt.parquet").write_bytes(b"not parquet")
  with pytest.raises(DatasetError, match="not a readable parquet file"):
    load_rows(tmp_path / "corrupt.parquet")


def make_rows(n):
  return [
    Row(({"role": "user", "content": str(i)},), str(i), "", {}, (), (), f"f:{i}") for i in range(n)
  ]


def test_split_is_deterministic_disjoint_and_covering():
  rows = make_rows(100)
  train, heldout = split_rows(rows, 0.1, seed=3)
  assert len(heldout) == 10 and len(train) == 90
  assert split_rows(rows, 0.1, seed=3) == (train, heldout)
  assert {r.where for r in train}.isdisjoint({r.where for r in heldout})
  assert sorted([r.where for r in train + heldout]) == sorted(r.where for r in rows)
  # Each side keeps file order; another seed holds out other rows.
  assert train == [r for r in rows if r in train]
  assert split_rows(rows, 0.1, seed=4)[1] != heldout
  assert heldout != rows[-10:] and heldout != rows[:10]


@pytest.mark.parametrize(
  "n, fraction, held",
  [
    (2, 0.01, 1),
    (2, 0.99, 1),
    (3, 0.5, 2),
    (10, 0.0, 0),
    (10, 1.0, 10),
    (1, 0.5, 0),
  ],
)
def test_split_sizes(n, fraction, held):
  assert len(split_rows(make_rows(n), fraction, seed=0)[1]) == held


def test_split_refuses_bad_fractions():
  with pytest.raises(ValueError, match="heldout_fraction"):
    split_rows(make_rows(3), 1.5, seed=0)


def test_rows_dataset():
  rows = make_rows(5)
  ds = datasets.rows_dataset(rows)
  assert len(ds) == 5 and ds[2] is rows[2]
  assert sorted(r.where for r in ds.shuffle(seed=1)) == sorted(r.where for r in rows)


def test_repeated_and_conflicting_prompts_are_dropped_with_their_lines(tmp_path):
  rows = [
    {"prompt": "What is 2+3?", "answer": "5"},  # 1: kept
    {"prompt": "What  is 2+3? ", "answer": " 5"},  # 2: the same, spaced: dropped
    {"prompt": "Name a prime.", "answer": "2"},  # 3: conflicts with 5
    {"prompt": "Say 7.", "answer": "7"},  # 4: kept
    {"prompt": "Name a prime.", "answer": "3"},  # 5: conflicts with 3
    {
      "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 7."}],
      "answer": "7",
    },
  ]  # 6: another prompt
  path = write_jsonl(tmp_path / "dup.jsonl", rows)
  kept, rejected = load_rows(path)
  assert [r.where for r in kept] == [f"{path}:1", f"{path}:4", f"{path}:6"]
  assert [(w, r.split(":")[0]) for w, r in rejected] == [
    (f"{path}:2", f"duplicate prompt of {path}"),
    (f"{path}:3", "conflicting ground truth"),
    (f"{path}:5", "conflicting ground truth"),
  ]
  assert datasets.hygiene_counts(rejected) == {
    "duplicate": 1,
    "conflicting": 2,
    "in_heldout": 0,
    "empty_prompt": 0,
    "assistant_final": 0,
    "other": 0,
  }
  with pytest.raises(DatasetError, match=f"{path}:2: duplicate prompt"):
    load_rows(path, strict=True)
  # "report": same-truth repeats are kept and listed; conflicts still go.
  repeats = []
  kept, rejected = load_rows(path, keep_repeats=True, repeats=repeats)
  assert [r.where for r in kept] == [f"{path}:{i}" for i in (1, 2, 4, 6)]
  assert repeats == [(f"{path}:2", f"duplicate prompt of {path}:1")] and len(rejected) == 2


@pytest.mark.parametrize(
  "prompt,reason",
  [
    ("", "prompt has no text"),
    ("  \n", "prompt has no text"),
    ([{"role": "system", "content": ""}, {"role": "user", "content": " "}], "prompt has no text"),
    (
      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
      "prompt ends with an assistant message",
    ),
  ],
)
def test_empty_and_assistant_final_prompts_are_refused(tmp_path, prompt, reason):
  path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "answer": "1"}, GOOD[1]])
  rows, rejected = load_rows(path)
  assert len(rows) == 1 and rejected[0][0] == f"{path}:1"
  assert rejected[0][1].startswith(reason)


def test_a_held_out_prompt_leaves_training_and_duplicates_split_together(tmp_path):
  from sao_jax.envs.dataset import DatasetConfig, DatasetEnv

  train = write_jsonl(
    tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]
  )
  held = write_jsonl(
    tmp_path / "held.jsonl", [{"prompt": " q2\n", "answer": "2"}, {"prompt": "h", "answer": "0"}]
  )
  env = DatasetEnv(DatasetConfig(path=train, heldout_path=held, use_sandbox=False))
  assert [r.messages[0]["content"] for r in env.train_rows] == ["q0", "q1", "q3", "q4", "q5"]
  assert env.rejected == [(f"{train}:3", f"prompt also held out at {held}:1")]
  assert env.data_counts["in_heldout"] == 1 and sum(env.data_counts.values()) == 1
  with pytest.raises(DatasetError, match="prompt also held out"):
    DatasetEnv(DatasetConfig(path=train, heldout_path=held, use_sandbox=False, strict=True))
  # heldout_fraction splits distinct prompts: rows of one prompt stay together.
  rows = make_rows(20) + [
    Row(({"role": "user", "content": f" {i}"},), str(i), "", {}, (), (), f"g:{i}")
    for i in range(20)
  ]
  for seed in range(5):
    train_rows, heldout = split_rows(rows, 0.25, seed)
    assert len(heldout) == 10  # 5 of 20 prompts, two rows each
    keys = {datasets.prompt_key(r) for r in heldout}
    assert not keys & {datasets.prompt_key(r) for r in train_rows}
