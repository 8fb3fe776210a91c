"""scripts/tiny_data.py (the esmc-tiny dataset): parsing, dedupe, substring groups, split, file format.

Synthetic records only, except the last test, which reads the Debian packages and is skipped
where they are not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name):
    """Import scripts/NAME.py as module NAME (scripts/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and `import tiny_data` look modules up here
        spec.loader.exec_module(module)
    return sys.modules[name]


td = load_script("tiny_data")


def rec(name, seq, licence="uniprot"):
    return td.Record(name, name.split(":")[-1], "", "", seq, "pkg", "file", licence)


def random_seq(rng, n):
    return "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(n))


def test_clean_and_parsers():
    assert td._clean("ac-d.e~f_g 12\nHK*") == "ACDEFGHK"
    assert td._clean("AC*DE*") == "AC*DE"  # an internal stop stays: the alphabet check rejects it
    fasta = ">sp|P69905|HBA_HUMAN Hemoglobin\nMVLS\nPADK\n>P1;CCCA\ncytochrome c\nGDVE KGKK*\n"
    assert list(td.parse_fasta(fasta)) == [
        ("sp|P69905|HBA_HUMAN", "P69905", "Hemoglobin", "MVLSPADK"),
        ("CCCA", "", "cytochrome c", "GDVEKGKK"),
    ]
    sto = (
        "# STOCKHOLM 1.0\n#=GF AC PF00001\n#=GS a/1-9 AC Q12345\na/1-9 AC-DE\nb/2-7 ..acd\n\na/1-9 FG\nb/2-7 EF.\n//\n"
    )
    assert list(td.parse_stockholm(sto)) == [
        ("a/1-9", "Q12345", "PF00001 seed member", "ACDEFG"),
        ("b/2-7", "b", "PF00001 seed member", "ACDEF"),
    ]


def test_dedupe_keeps_highest_priority_copy_and_notes_the_others():
    records = [
        rec("p:f:pf1", "MKVLAAGIVG", "pfam"),
        rec("p:f:ref", "MKVLAAGIVG", "refseq"),
        rec("p:f:up", "MKVLAAGIVG", "uniprot"),
        rec("p:f:ins1", "WWWWYYYYHH", "insdc"),
        rec("p:f:ins2", "WWWWYYYYHH", "insdc"),
    ]
    unique = {r.seq: r for r in td.dedupe(records)}
    assert len(unique) == 2
    assert unique["MKVLAAGIVG"].name == "p:f:up"
    assert unique["MKVLAAGIVG"].also_in == ["p:f:ref", "p:f:pf1"]  # in priority order
    assert unique["WWWWYYYYHH"].name == "p:f:ins1"  # same origin: file order wins
    assert unique["WWWWYYYYHH"].also_in == ["p:f:ins2"]


def test_substring_groups_put_fragments_with_their_parent():
    import random

    rng = random.Random(3)
    parent, other = random_seq(rng, 120), random_seq(rng, 80)
    records = [
        rec("a:f:domain", parent[30:70]),
        rec("a:f:other", other),
        rec("a:f:full", parent),
        rec("a:f:nterm", parent[:25]),
    ]
    groups = td.substring_groups(records)
    as_names = sorted(sorted(records[i].name for i in g) for g in groups)
    assert as_names == [["a:f:domain", "a:f:full", "a:f:nterm"], ["a:f:other"]]


def test_split_fills_test_then_val_keeps_groups_whole_and_is_seeded():
    import random

    rng = random.Random(5)
    records = []
    for i in range(200):
        s = random_seq(rng, 40 + i % 30)
        records.append(rec(f"x:f:{i:03d}", s))
        if i % 10 == 0:  # a fragment that must share its parent's split
            records.append(rec(f"x:f:{i:03d}frag", s[5:30]))
    splits, n_groups = td.split(records, seed=0)
    assert n_groups == 200 and set(splits) == {r.name for r in records}
    for r in records:
        if r.name.endswith("frag"):
            assert splits[r.name] == splits[r.name.removesuffix("frag")]
    counts = Counter(splits.values())
    n = len(records)
    # groups are taken until the split holds at least its share; a group has at most 2 records
    assert 0.10 * n <= counts["test"] < 0.10 * n + 2
    assert 0.15 * n <= counts["test"] + counts["val"] < 0.15 * n + 2
    assert td.split(records, seed=0)[0] == splits
    assert td.split(records, seed=1)[0] != splits


def test_written_dataset_reads_back_by_split(tmp_path):
    records = [rec("b:f:two", "M" * 130, "pfam"), rec("a:f:one", "ACDEFGHIKL" * 3)]
    splits = {"a:f:one": "train", "b:f:two": "test"}
    path = tmp_path / "data.fasta"
    order = td.write_dataset(records, splits, path)
    assert [r.name for r in order] == ["a:f:one", "b:f:two"]
    lines = path.read_text().splitlines()
    assert lines[0] == ">a:f:one split=train acc=- licence=uniprot"
    assert [len(x) for x in lines[3:]] == [60, 60, 10]  # 60 residues a line
    assert td.load_dataset(path) == {"train": [("a:f:one", "ACDEFGHIKL" * 3)], "test": [("b:f:two", "M" * 130)]}


@pytest.mark.skipif(
    not all(root.exists() for root in (td.EMBOSS, td.HMMER, td.ANY2FASTA)),
    reason="needs apt packages emboss-test hmmer-examples any2fasta-examples",
)
@pytest.mark.slow  # over 5 s on the 2-core host (--durations=0)
def test_debian_packages_give_the_documented_dataset(tmp_path):
    """The figures of docs/esmc-tiny.md and the sha256 of the dataset the shipped model used."""
    records, per_file = td.gather()
    unique = td.dedupe(records)
    splits, n_groups = td.split(unique, seed=0)
    assert (len(records), len(unique), n_groups) == (5160, 4878, 4865)
    assert Counter(splits.values()) == {"train": 4146, "val": 244, "test": 488}
    td.write_dataset(unique, splits, tmp_path / "d.fasta")
    assert hashlib.sha256((tmp_path / "d.fasta").read_bytes()).hexdigest() == (
        "58dc59e5642ae6c56934ef43add632abeb366126570c002bf9bf3672fa1a24a9"
    )
