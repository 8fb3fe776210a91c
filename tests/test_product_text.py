"""The product speaks of the product: no work-log narration anywhere in the tree (rounds of work
by ordinal or number, issue numbers, dated runs, "we tried"), and the size caps of the
benchmark reference, its raw data and the benchmark scripts. History lives in git log and in
docs/decisions.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


SCANNED = ("esmc_mlx", "tests", "benchmarks", "scripts", "docs", ".ci", "README.md", "Makefile", "pyproject.toml")
CHECKER = "tests/test_product_text.py"  # this file: its planted phrases are the checker's test data
NOT_TEXT = {".safetensors", ".png", ".pyc", ".npy", ".npz", ".h5", ".gz", ".fasta", ".so", ".whl"}
BENCHMARKS_MD_MAX_LINES = 500
BENCH_DATA_MAX_FILES = 40
BENCHMARK_SCRIPTS_MAX = 20

_ORDINAL = (
    r"(?:(?:twenty|thirty|forty|fifty)-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
    r"|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth"
    r"|nineteenth|twentieth|thirtieth|fortieth|fiftieth|\d+(?:st|nd|rd|th)"
)
DIARY = [
    ("a round of work by ordinal", rf"\b(?:{_ORDINAL})[\s-]+(?:issue[\s-]?\d+[\s-]+)?(?:session|round)s?\b"),
    ("a round of work by number", r"\b(?:session|round)[\s-]?#?\d+"),
    ("an issue number", r"\bissues?[\s-]?#?\d+"),
    ("a work-log phrase", r"\bwe tried\b|\b(?:last|next|this|previous|earlier) session\b|\bpreviously\b"),
    ("a dated run", r"\b20\d\d-[01]\d-[0-3]\d\b"),
]
PROSE_ONLY = [  # in docs: in code these name real things (validate reads the load average)
    ("a load average", r"\bload average"),
    ("a test count", r"\b\d[\d,]* (?:tests|passed)\b(?![/.\w])"),  # not "-n 8 tests/test_x.py"
]


def diary_phrases(text: str, prose: bool = True) -> list[str]:
    """Each work-log phrase in ``text``, as 'what: the phrase'."""
    rules = DIARY + (PROSE_ONLY if prose else [])
    return [f"{what}: {m[0]!r}" for what, pattern in rules for m in re.finditer(pattern, text, re.IGNORECASE)]


def _strings(value, key: str | None = None):
    """Every string of a JSON document but the values of ``date`` keys (raw data records when it ran)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v, key)
    elif isinstance(value, str) and key != "date":
        yield value


def file_findings(path: Path, rel: str) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            text = "\n".join(_strings(json.loads(text)))
        except ValueError:
            pass
    if rel == "docs/decisions.md":  # its last column holds commits; issue numbers may stand there
        text = "\n".join(line.rsplit("|", 2)[0] if line.startswith("|") else line for line in text.splitlines())
    return [f"{rel}: {hit}" for hit in diary_phrases(text, prose=path.suffix == ".md")]


def tree_files(root: Path = ROOT):
    for top in SCANNED:
        start = root / top
        paths = [start] if start.is_file() else sorted(p for p in start.rglob("*") if p.is_file())
        for path in paths:
            rel = path.relative_to(root).as_posix()
            if path.suffix in NOT_TEXT or "__pycache__" in path.parts or rel == CHECKER:
                continue
            yield path, rel


def test_no_work_log_narration_in_the_tree():
    found = [hit for path, rel in tree_files() for hit in file_findings(path, rel)]
    assert not found, "work-log narration (history goes to git log and docs/decisions.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "phrase",
    [
        "the forty-seventh issue-16 session kept it",
        "measured in the Twenty-third session",
        "first round of the audit",
        "see issue-16",
        "as issue 12 asked",
        "fixed in round 11",
        "session 31 ran it",
        "we tried a second stream",
        "the last session's bench",
        "a 12th round",
        "measured 2026-12-04 on the H200",
        "previously the default",
    ],
)
def test_the_checker_finds_a_planted_phrase(tmp_path, phrase):
    for name in ("docs/x.md", "esmc_mlx/x.py", "benchmarks/x.py", "tests/x.py"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"A line.\n# {phrase}\n")
    found = {rel: file_findings(path, rel) for path, rel in tree_files(tmp_path)}
    assert len(found) == 4 and all(found.values()), found


def test_the_checker_reads_json_strings_but_not_dates_and_keeps_prose_rules_to_docs(tmp_path):
    raw = tmp_path / "docs" / "bench" / "x.json"
    raw.parent.mkdir(parents=True)
    raw.write_text(json.dumps({"machine": {"date": "2026-12-04"}, "rows": [{"ms": 1.5}]}))
    assert file_findings(raw, "docs/bench/x.json") == []
    raw.write_text(json.dumps({"what": "the ninth session's run", "date": "2026-12-04"}))
    assert len(file_findings(raw, "docs/bench/x.json")) == 1
    code = tmp_path / "x.py"
    code.write_text("os.getloadavg()  # the 1-minute load average\n")
    assert file_findings(code, "x.py") == []
    doc = tmp_path / "x.md"
    doc.write_text("Measured at load average 8; 853 tests passed.\n")
    assert len(file_findings(doc, "x.md")) == 2
    doc.write_text("python -m pytest -n 8 tests/test_kernels.py\n")
    assert file_findings(doc, "x.md") == []


def test_the_checker_leaves_ordinary_words_alone(tmp_path):
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text(
        "Batches are dealt out round-robin; the first pass warms the cache; a round trip to the host;\n"
        "one server for the pytest session; values round to bf16; round(x, 2); the second run.\n"
    )
    assert file_findings(doc, "docs/x.md") == []


def test_decisions_may_name_an_issue_in_their_commit_column_only(tmp_path):
    doc = tmp_path / "decisions.md"
    doc.write_text("| decision | kept | figure | commit |\n| a | yes | 1.2x | abc1234 (issue 16) |\n")
    assert file_findings(doc, "docs/decisions.md") == []
    doc.write_text("| a, as issue 16 asked | yes | 1.2x | abc1234 |\n")
    assert len(file_findings(doc, "docs/decisions.md")) == 1


def test_benchmark_reference_and_its_data_stay_small():
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= BENCHMARKS_MD_MAX_LINES, f"docs/benchmarks.md has {lines} lines"
    files = [p for p in (ROOT / "docs" / "bench").iterdir() if p.is_file()]
    assert len(files) <= BENCH_DATA_MAX_FILES, f"docs/bench holds {len(files)} files"
    scripts = [p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"]
    assert len(scripts) <= BENCHMARK_SCRIPTS_MAX, f"benchmarks/ holds {len(scripts)} scripts"


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_benchmark_script_is_run_by_a_command_a_doc_gives():
    docs = _docs_text()
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        rel = script.relative_to(ROOT).as_posix()
        if script.name == "__init__.py":
            continue
        name = script.stem
        assert f"python -m benchmarks.{name}" in docs or f"python {rel}" in docs, f"no doc runs {rel}"


def test_docs_bench_holds_what_a_doc_cites_and_each_citation_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = set()
    for doc in docs:
        for name in re.findall(r"(?:\(|docs/)bench/([\w.-]+)", doc.read_text()):
            assert (ROOT / "docs" / "bench" / name).is_file(), f"{doc.name} cites docs/bench/{name}, which is not there"
            cited.add(name)
    uncited = sorted(p.name for p in (ROOT / "docs" / "bench").iterdir() if p.name not in cited)
    assert not uncited, f"docs/bench holds files no doc cites: {uncited}"
