#!/usr/bin/env python3
"""Gather the esmc-tiny dataset from Debian packages; write it and the validation panel.

The sequences are the real proteins that three Debian packages ship as plain files:

    apt-get install emboss-test hmmer-examples any2fasta-examples
    python scripts/tiny_data.py [--seed 0] [--list-test]

Parse every file in SOURCES, clean and filter the records, drop exact duplicates (keeping the copy
of the highest-priority origin), group exact substrings with their parent, split the groups into
test / val / train with random.Random(seed), and write

- scripts/data/esmc-tiny-dataset.fasta: one record per unique sequence, header
  ``>package:file:id split=... acc=... licence=...`` (what ``train_tiny.py train`` reads);
- scripts/data/esmc-tiny-manifest.json: per-file counts, Debian versions, the dataset's sha256;
- esmc_mlx/data/panel.fasta and PANEL.md: the validation panel, picked from the test split.

``python scripts/train_tiny.py prepare`` runs the same step. docs/esmc-tiny.md has the figures.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "scripts" / "data"
DATASET = DATA_DIR / "esmc-tiny-dataset.fasta"
MANIFEST = DATA_DIR / "esmc-tiny-manifest.json"
PANEL_FASTA = REPO / "esmc_mlx" / "data" / "panel.fasta"
PANEL_MD = REPO / "esmc_mlx" / "data" / "PANEL.md"

EMBOSS = Path("/usr/share/EMBOSS/test")
HMMER = Path("/usr/share/doc/hmmer/examples")
ANY2FASTA = Path("/usr/share/doc/any2fasta/examples")

# licence keys -> what the docs and PANEL.md say about a record's origin and terms
LICENCES = {
    "uniprot": "UniProtKB entry (the 2012 files carry UniProt's then CC BY-ND notice; UniProt "
    "distributes all its data under CC BY 4.0 today). Attribution: The UniProt Consortium",
    "insdc": "INSDC (EMBL-Bank/GenBank/DDBJ) CDS translation: no restrictions on use or redistribution",
    "refseq": "NCBI RefSeq CDS translation: NCBI places no restrictions on use or distribution",
    "pfam": "Pfam seed alignment member (Pfam is CC0 1.0); sequence from UniProtKB (CC BY 4.0)",
    "pir": "PIR-International Protein Sequence Database (PIR-PSD), freely distributed",
    "wormbase": "WormBase wormpep: freely available, no restrictions",
    "emboss-fasta": "UniProtKB/Swiss-Prot sequence copied into an EMBOSS test file (CC BY 4.0 today)",
}

# (package, root, relative path, format, licence key). Chosen by reading the files: synthetic
# test sequences (prot.*, ambigprot, 20aa, 3box, M1, rndseq400) and nucleotide files are left out.
SOURCES = [
    ("emboss-test", EMBOSS, "swiss/seq.dat", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "swnew/trembl.dat", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/uniprotft.sw", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/exu2_drops.sw", "swiss", "uniprot"),
    ("emboss-test", EMBOSS, "data/amir.swiss", "swiss", "uniprot"),
    *[
        ("emboss-test", EMBOSS, f"embl/{n}.dat", "embl", "insdc")
        for n in ("fun", "hum1", "inv", "pln", "pro", "rod", "syn", "vrt")
    ],
    *[
        ("emboss-test", EMBOSS, f"genbank/{n}.seq", "genbank", "insdc")
        for n in ("gbbct1", "gbinv1", "gbpln1", "gbpln2", "gbpri1", "gbrod1", "gbvrt")
    ],
    *[("emboss-test", EMBOSS, f"pir/pir{i}.seq", "fasta", "pir") for i in (1, 2, 3, 4)],
    ("emboss-test", EMBOSS, "data/104k.nbrf", "fasta", "pir"),
    ("emboss-test", EMBOSS, "wormpep/wormpep", "fasta", "wormbase"),
    ("emboss-test", EMBOSS, "data/wormpep.clone.AB", "fasta", "wormbase"),
    ("emboss-test", EMBOSS, "data/wormpep.clone.ZK637", "fasta", "wormbase"),
    *[
        ("emboss-test", EMBOSS, f"data/{n}", "fasta", "emboss-fasta")
        for n in (
            "globins.fasta",
            "hba.fa",
            "memepep.dat",
            "memeseqs.dat",
            "ops.fasta",
            "opsd.fasta",
            "op1.ali",
            "op2.ali",
            "paamir.pep",
            "tranalign.pep",
            "twoglob.fasta",
            "featprot.fasta",
            "iprtest.seq",
            "swnew",
            "swsplit",
        )
    ],
    ("emboss-test", EMBOSS, "data/PF00032_seed.sth", "stockholm", "pfam"),
    ("hmmer-examples", HMMER, "tutorial/7LESS_DROME", "swiss", "uniprot"),
    ("hmmer-examples", HMMER, "tutorial/HBB_HUMAN", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "tutorial/globins45.fa", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "testsuite/PAX8_HUMAN", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/formats/fasta", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/formats/uniprot.gz", "swiss", "uniprot"),
    ("hmmer-examples", HMMER, "easel/demotic/examples/example.fa", "fasta", "uniprot"),
    ("hmmer-examples", HMMER, "easel/demotic/examples/example-single.fa.gz", "fasta", "uniprot"),
    *[
        ("hmmer-examples", HMMER, p, "stockholm", "pfam")
        for p in (
            "tutorial/globins4.sto",
            "tutorial/fn3.sto",
            "tutorial/Pkinase.sto",
            "testsuite/RRM_1.sto.gz",
            "testsuite/Caudal_act.sto.gz",
            "testsuite/Patched.sto.gz",
            "testsuite/LuxC.sto.gz",
            "testsuite/SMC_N.sto.gz",
            "testsuite/XYPPX.sto",
            "testsuite/minifam.gz",
            "easel/demotic/examples/example.sto.gz",
        )
    ],
    ("any2fasta-examples", ANY2FASTA, "test.gbk.gz", "genbank", "refseq"),
    ("any2fasta-examples", ANY2FASTA, "test.sth", "stockholm", "pfam"),
]
PRIORITY = ["uniprot", "refseq", "insdc", "pir", "wormbase", "emboss-fasta", "pfam"]

AMINO = set("ACDEFGHIKLMNPQRSTVWYXBZUO")
STANDARD = "LAGVSERTIDPKQNFYMHWC"  # the 20 standard residues, in ESMC's token order (ids 4..23)
MIN_LEN, MAX_CROP = 20, 1022
TEST_FRACTION, VAL_FRACTION = 0.10, 0.05


@dataclass
class Record:
    name: str  # unique: package:path:id
    id: str
    acc: str
    desc: str
    seq: str
    package: str
    path: str
    licence: str
    also_in: list = field(default_factory=list)


# --- parsers -----------------------------------------------------------------------------------
def _read(path: Path) -> str:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("latin-1")


def _clean(seq: str) -> str:
    """Ungap and uppercase; drop a terminal stop. An internal stop stays, so that the alphabet
    check rejects the record (a frame translation, not a protein)."""
    return re.sub(r"[\s\d.\-~_]", "", seq).upper().rstrip("*")


def parse_swiss(text):
    for entry in text.split("\n//"):
        lines = entry.strip("\n").splitlines()
        ids = [ln.split()[1] for ln in lines if ln.startswith("ID   ")]
        if not ids:
            continue
        acc = next((ln[5:].split(";")[0].strip() for ln in lines if ln.startswith("AC   ")), "")
        desc = " ".join(ln[5:].strip() for ln in lines if ln.startswith("DE   "))
        desc = (re.search(r"Full=([^;]+);", desc) or re.match(r"(.*)", desc)).group(1)
        try:
            start = next(i for i, ln in enumerate(lines) if ln.startswith("SQ   "))
        except StopIteration:
            continue
        yield ids[0], acc, desc, _clean("".join(lines[start + 1 :]))


def parse_fasta(text):
    name, desc, chunks = None, "", []
    for line in text.splitlines() + [">"]:
        if line.startswith(">"):
            if name is not None:
                yield name, _acc_from(name, desc), desc, _clean("".join(chunks))
            head = line[1:].strip()
            if head.startswith(("P1;", "F1;")):  # NBRF/PIR: >P1;ID, the next line is the title
                head = head[3:]
                name, desc, chunks = head.split()[0] if head else "", None, []
                continue
            name, _, desc = head.partition(" ")
            chunks = []
        elif name is not None:
            if desc is None:  # NBRF title line
                desc = line.strip()
                continue
            chunks.append(line)


def _acc_from(name, desc):
    m = re.match(r"(?:sp|tr)\|([A-Z0-9]+)\|", name)
    if m:
        return m.group(1)
    m = re.match(r"\s*([OPQ][0-9][A-Z0-9]{3}[0-9]|[A-NR-Z][0-9](?:[A-Z][A-Z0-9]{2}[0-9]){1,2})\b", desc or "")
    return m.group(1) if m else ""


def parse_stockholm(text):
    for block in text.split("\n//"):
        seqs, accs, family = {}, {}, ""
        for line in block.splitlines():
            if line.startswith("#=GF AC"):
                family = line.split()[2]
            elif line.startswith("#=GS") and " AC " in line:
                parts = line.split()
                accs[parts[1]] = parts[3]
            elif line.strip() and not line.startswith("#"):
                parts = line.split()
                if len(parts) == 2:
                    seqs[parts[0]] = seqs.get(parts[0], "") + parts[1]
        for name, aligned in seqs.items():
            yield name, accs.get(name, name.split("/")[0]), f"{family} seed member", _clean(aligned)


def parse_features(text, embl: bool):
    """CDS /translation qualifiers of EMBL or GenBank flat files."""
    for entry in text.split("\n//"):
        lines = entry.splitlines()
        if embl:
            record_acc = next((ln[5:].split(";")[0].strip() for ln in lines if ln.startswith("AC   ")), "")
            feats = ["  " + ln[2:] for ln in lines if ln.startswith("FT")]
        else:
            record_acc = next((ln.split()[1] for ln in lines if ln.startswith("ACCESSION")), "")
            try:
                a = next(i for i, ln in enumerate(lines) if ln.startswith("FEATURES"))
                b = next(i for i, ln in enumerate(lines) if ln.startswith("ORIGIN") or i > a and ln[:1].isalpha())
            except StopIteration:
                continue
            feats = lines[a + 1 : b]
        current, blocks = None, []
        for ln in feats:
            if len(ln) > 5 and ln[:5] == "     " and ln[5] != " ":
                current = [ln[5:].split()[0], ""]
                blocks.append(current)
            elif current is not None:
                s = ln.strip()
                current[1] += ("\n" if s.startswith("/") else " ") + s
        for key, quals in blocks:
            if key != "CDS":
                continue
            q = {k: a or b for k, a, b in re.findall(r'^/(\w+)(?:="([^"]*)"|=([^"\n]*))?', quals, re.MULTILINE)}
            if "translation" not in q:
                continue
            pid = q.get("protein_id") or q.get("locus_tag") or q.get("gene") or record_acc
            yield pid, q.get("protein_id", record_acc), q.get("product", ""), _clean(q["translation"])


PARSERS = {
    "swiss": parse_swiss,
    "fasta": parse_fasta,
    "stockholm": parse_stockholm,
    "embl": lambda t: parse_features(t, embl=True),
    "genbank": lambda t: parse_features(t, embl=False),
}


# --- prepare -----------------------------------------------------------------------------------
def gather(sources=SOURCES):
    """Parse, clean and filter every source file; returns the records and per-file counts."""
    records, per_file, missing = [], [], []
    for package, root, rel, fmt, lic in sources:
        path = root / rel
        if not path.exists():
            missing.append(f"{package}: {path}")
            continue
        raw = list(PARSERS[fmt](_read(path)))
        kept = 0
        for ident, acc, desc, seq in raw:
            if len(seq) < MIN_LEN or not set(seq) <= AMINO:
                continue
            if sum(seq.count(c) for c in "ACGTUN") > 0.9 * len(seq):  # nucleotide, not protein
                continue
            records.append(Record(f"{package}:{rel}:{ident}", ident, acc, (desc or "").strip(), seq, package, rel, lic))
            kept += 1
        per_file.append(
            {"package": package, "file": str(path), "format": fmt, "licence": lic, "parsed": len(raw), "kept": kept}
        )
    if missing:
        sys.exit(
            "missing input files (apt-get install emboss-test hmmer-examples any2fasta-examples):\n  "
            + "\n  ".join(missing)
        )
    return records, per_file


def dedupe(records):
    """Exact duplicates: keep the copy of the highest-priority origin (PRIORITY), note the others."""
    by_seq = {}
    for r in sorted(records, key=lambda r: PRIORITY.index(r.licence)):  # stable: file order within a kind
        if r.seq in by_seq:
            by_seq[r.seq].also_in.append(r.name)
        else:
            by_seq[r.seq] = r
    return list(by_seq.values())


def substring_groups(records, k=8):
    """Union-find groups: a sequence that is an exact substring of another (a fragment, a Pfam
    domain of a full-length entry) goes into the same split as its parent."""
    parent = list(range(len(records)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = defaultdict(set)
    for i, r in enumerate(records):
        for j in range(len(r.seq) - k + 1):
            index[r.seq[j : j + k]].add(i)
    for i, r in enumerate(records):
        for j in index.get(r.seq[:k], ()):
            if j != i and len(records[j].seq) > len(r.seq) and r.seq in records[j].seq:
                parent[find(i)] = find(j)
    groups = defaultdict(list)
    for i in range(len(records)):
        groups[find(i)].append(i)
    return sorted(groups.values(), key=lambda g: min(records[i].name for i in g))


def split(records, seed):
    """Shuffled substring groups fill test up to 10% of the sequences, then val up to 15%; the rest
    is train. Returns {record name: split} and the number of groups."""
    groups = substring_groups(records)
    rng = random.Random(seed)
    rng.shuffle(groups)
    n = len(records)
    splits, taken = {}, 0
    for g in groups:
        if taken < TEST_FRACTION * n:
            name = "test"
        elif taken < (TEST_FRACTION + VAL_FRACTION) * n:
            name = "val"
        else:
            name = "train"
        for i in g:
            splits[records[i].name] = name
        taken += len(g)
    return splits, len(groups)


# Validation panel: record names picked by hand from the held-out (test) split of seed 0 so
# that lengths run from ~30 to >1000 and one record carries ambiguity codes (see PANEL.md).
PANEL = [
    ("emboss-test:swiss/seq.dat:FLAV_NOSSM", "shortest; Glx ambiguity (Z); held-out has no X/B/Z record"),
    ("any2fasta-examples:test.gbk.gz:WP_004750287.1", "short bacterial protein (RefSeq)"),
    ("hmmer-examples:testsuite/RRM_1.sto.gz:SXL_DROME/127-198", "single domain (RRM), ungapped Pfam seed row"),
    ("emboss-test:pir/pir1.seq:CCCA", "Asx/Glx ambiguity (B, Z); held-out has no X/B/Z record"),
    ("emboss-test:swiss/seq.dat:HBB_HUMAN", "haemoglobin beta, the classic"),
    ("emboss-test:swiss/seq.dat:FLAV_SYNP2", "small alpha/beta enzyme cofactor protein"),
    ("emboss-test:swiss/seq.dat:SSRL_TAKRU", "7-TM membrane receptor"),
    ("emboss-test:swiss/seq.dat:ACTC_TAKRU", "actin"),
    ("emboss-test:data/uniprotft.sw:AACT_HUMAN", "serpin"),
    ("emboss-test:swiss/seq.dat:PAXI_HUMAN", "disordered + LIM domains"),
    ("emboss-test:embl/inv.dat:CAC42391.1", "INSDC CDS translation"),
    ("emboss-test:swnew/trembl.dat:Q4JHL5_TAKRU", "unreviewed TrEMBL entry"),
    ("hmmer-examples:testsuite/SMC_N.sto.gz:SMC2_CHICK/2-1167", "longer than the 1022-residue training crop"),
    ("emboss-test:data/swsplit:KPB2_FUGRU", "longest (> 1000 residues)"),
]


def prepare(seed: int = 0, list_test: bool = False) -> None:
    """Gather, deduplicate and split; write the dataset, the manifest and the validation panel."""
    records, per_file = gather()
    unique = dedupe(records)
    splits, n_groups = split(unique, seed)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    order = write_dataset(unique, splits, DATASET)
    manifest = build_manifest(
        records, per_file, unique, splits, n_groups, hashlib.sha256(DATASET.read_bytes()).hexdigest(), seed
    )
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("files", "licences")}, indent=1))
    if list_test:
        for r in order:
            if splits[r.name] == "test":
                amb = "".join(sorted(set(r.seq) - set(STANDARD)))
                print(f"{len(r.seq):5d} {amb or '-':4s} {r.name} {r.acc} {r.desc[:60]}")
    write_panel({r.name: r for r in unique}, splits)


def write_dataset(unique, splits, path):
    """One FASTA record per unique sequence, sorted by name, 60 residues a line; returns that order."""
    order = sorted(unique, key=lambda r: r.name)
    with open(path, "w") as f:
        for r in order:
            f.write(f">{r.name} split={splits[r.name]} acc={r.acc or '-'} licence={r.licence}\n")
            f.write("\n".join(r.seq[i : i + 60] for i in range(0, len(r.seq), 60)) + "\n")
    return order


def build_manifest(records, per_file, unique, splits, n_groups, dataset_sha256, seed):
    residues = Counter()
    for r in unique:
        residues[splits[r.name]] += len(r.seq)
    lengths = sorted(len(r.seq) for r in unique)
    return {
        "apt_packages": {p: _deb_version(p) for p in ("emboss-test", "hmmer-examples", "any2fasta-examples")},
        "files": per_file,
        "records_parsed_and_kept": len(records),
        "unique_sequences": len(unique),
        "substring_groups": n_groups,
        "unique_by_package": dict(Counter(r.package for r in unique)),
        "unique_by_licence": dict(Counter(r.licence for r in unique)),
        "split_sequences": dict(Counter(splits.values())),
        "split_residues": dict(residues),
        "length_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "longer_than_1022": sum(n > MAX_CROP for n in lengths),
        "dataset_sha256": dataset_sha256,
        "seed": seed,
        "licences": LICENCES,
    }


def _deb_version(package):
    try:
        text = Path("/var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(rf"^Package: {re.escape(package)}\n(?:.+\n)*?Version: (.+)$", text, re.MULTILINE)
    return m.group(1) if m else None


def write_panel(by_name, splits):
    if not PANEL:
        return
    fasta, rows = [], []
    for name, note in PANEL:
        r = by_name[name]
        desc = r.desc.removeprefix(r.acc).strip() if r.acc else r.desc
        fasta.append(f">{r.id} {r.acc or '-'} {desc[:70]}".rstrip())
        fasta += [r.seq[i : i + 60] for i in range(0, len(r.seq), 60)]
        amb = ",".join(sorted(set(r.seq) - set(STANDARD))) or "-"
        rows.append(
            f"| {r.id} | {r.acc or '-'} | {len(r.seq)} | {amb} | {splits[name]} | "
            f"`{r.package}`: `{r.path}` | {LICENCES[r.licence].split(':')[0].split(' (')[0]} | {note} |"
        )
    PANEL_FASTA.write_text("\n".join(fasta) + "\n")
    PANEL_MD.write_text(PANEL_HEADER + "\n".join(rows) + "\n" + PANEL_FOOTER)
    print(f"wrote {PANEL_FASTA} ({len(PANEL)} records) and {PANEL_MD}")


PANEL_HEADER = """# Validation panel

`panel.fasta` holds real public protein sequences that `esmc-mlx validate` runs through the
reference and the converted model. They were picked from the held-out 10% of the esmc-tiny
dataset (split `test` below; seed 0), so the shipped esmc-tiny never trained on them, except
where the split column says otherwise. The validation code builds the two-chain and `<mask>`
inputs from these records; they are not stored here.

Regenerate with `python scripts/train_tiny.py prepare` (needs the Debian packages
`emboss-test`, `hmmer-examples` and `any2fasta-examples`; docs/esmc-tiny.md has the details).

| id | accession | length | non-standard residues | split | source (Debian package: file) | origin / licence | why |
| --- | --- | --- | --- | --- | --- | --- | --- |
"""
PANEL_FOOTER = (
    """
Origins and terms:

"""
    + "\n".join(f"- {k}: {v}" for k, v in LICENCES.items())
    + """

The Debian packages that carry these files are `emboss-test` (EMBOSS licence: GPL/LGPL for the
software; the sequence records themselves come from the public databases named above),
`hmmer-examples` (GPL-3 / Janelia Farm licence for the HMMER and Easel files) and
`any2fasta-examples` (GPL-3 for the package; test.gbk is NCBI RefSeq data).
"""
)


# --- reading the prepared dataset -----------------------------------------------------------
def load_dataset(path):
    """The prepared FASTA as {split: [(name, sequence), ...]}, in file order."""
    seqs = defaultdict(list)
    name, split_name, chunks = None, None, []
    for line in Path(path).read_text().splitlines() + [">"]:
        if line.startswith(">"):
            if name is not None:
                seqs[split_name].append((name, "".join(chunks)))
            if line == ">":
                break
            head = line[1:].split()
            name, split_name, chunks = head[0], dict(kv.split("=", 1) for kv in head[1:])["split"], []
        else:
            chunks.append(line.strip())
    return seqs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prepare_arguments(ap)
    args = ap.parse_args(argv)
    prepare(args.seed, args.list_test)


def add_prepare_arguments(ap):
    """The flags of the prepare step (also `train_tiny.py prepare`)."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list-test", action="store_true", help="print the held-out records")


if __name__ == "__main__":
    main()
